"""Green-context partition experiment: how the split mode's K1/K2 SM counts shape one call.

For each split, one traced call gives every block's start and finish stamps (%globaltimer):
K1's span (routing, dispatch, L1), K2's span (L2, scatter), how much of K2's span overlaps
K1's, and K3 (the reduce) as the rest of the graph's device time. The fused mode is the
yardstick. Run on a Hopper GPU:

    python examples/split_partitions.py [--preset flash] [--tokens 4096] [--splits 64,80,88,96,104]
"""

import argparse

import numpy as np

from megamoe_rt import MegaMoE, require_gpu
from megamoe_rt.kernels.fused import TRACE_EVENTS
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset
from megamoe_rt.testing import trace_buffer

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="flash")
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--splits", default="64,80,88,96,104", help="K1 SM counts; K2 takes the rest, K3 the whole GPU")
a = ap.parse_args()

# Before CuPy is imported: without the cu13 extra or a Hopper GPU, one line says what is missing.
require_gpu()

import cupy as cp

p = get_preset(a.preset)
experts, t, topk = p.num_experts // DEFAULT_EP_RANKS, a.tokens, p.num_topk  # one rank's EP8 slice
rs = cp.random.RandomState(0)
x = (rs.randint(0, 126, size=(t, p.hidden)) | (rs.randint(0, 2, size=(t, p.hidden)) << 7)).astype(cp.uint8)
x_sf = rs.uniform(0.001, 0.01, size=(t, p.hidden // 128)).astype(cp.float32)
topk_idx = cp.argsort(rs.standard_normal((t, experts)), axis=1)[:, :topk].astype(cp.int32)
topk_weights = cp.full((t, topk), 1.0 / topk, dtype=cp.float32)
w1 = rs.randint(0, 126, size=(experts, 2 * p.intermediate, p.hidden)).astype(cp.uint8)
w1_sf = rs.uniform(1e-4, 1e-3, size=(experts, 2 * p.intermediate // 128, p.hidden // 128)).astype(cp.float32)
w2 = rs.randint(0, 126, size=(experts, p.hidden, p.intermediate)).astype(cp.uint8)
w2_sf = rs.uniform(1e-4, 1e-3, size=(experts, p.hidden // 128, p.intermediate // 128)).astype(cp.float32)
args = (x, x_sf, topk_idx, topk_weights)
# The calls run on their own stream: the inputs above (made on CuPy's current stream) must be
# complete first, and load_weights runs on the calls' stream so they see the weights.
cp.cuda.get_current_stream().synchronize()
stream = cp.cuda.Stream(non_blocking=True)


def device_us(layer, reps=20):
    """Median device time of a call, in µs: the call captured into a CUDA graph and replayed, so
    the host's time to issue it stays out of the measurement."""
    y = cp.empty((t, p.hidden), dtype=cp.uint16)
    with stream:
        layer(*args, out=y, stream=stream)  # compiled and built outside the capture
        stream.synchronize()
        stream.begin_capture()
        layer(*args, out=y, stream=stream)
        graph = stream.end_capture()
        times = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return float(np.median(times))


fused = MegaMoE(p.hidden, p.intermediate, experts, topk, t, mode="fused")
fused.load_weights(w1, w1_sf, w2, w2_sf, stream=stream)
y_fused = fused(*args)
fused_us = device_us(fused)
print(
    f"{a.preset} T={t} ({experts} local experts, top-{topk}) on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
)
print(f"fused: {fused_us:.1f} us\n")
print(
    f"{'K1':>4} {'K2':>4} | {'call us':>8} {'x fused':>7} | {'K1 us':>7} {'K2 us':>7} {'K2 in K1':>8} {'K3+gaps':>8} | bitwise"
)
start_col, done_col = TRACE_EVENTS.index("start"), TRACE_EVENTS.index("math_done")
for l1 in (int(v) for v in a.splits.split(",")):
    sms = (l1, fused.device_info.sm_count - l1, fused.device_info.sm_count)
    layer = MegaMoE(p.hidden, p.intermediate, experts, topk, t, mode="split", split_sms=sms)
    layer.load_weights(w1, w1_sf, w2, w2_sf, stream=stream)
    same = bool(cp.array_equal(layer(*args), y_fused))
    call_us = device_us(layer)
    with trace_buffer(layer) as stamps, stream:
        layer(*args, stream=stream)
        stream.synchronize()
    s = cp.asnumpy(stamps).astype(np.int64)
    k1 = s[:l1, start_col].min(), s[:l1, done_col].max()
    k2 = s[l1 : l1 + sms[1], start_col].min(), s[l1 : l1 + sms[1], done_col].max()
    k1_us, k2_us = (k1[1] - k1[0]) / 1e3, (k2[1] - k2[0]) / 1e3
    overlap = max(0, min(k1[1], k2[1]) - max(k1[0], k2[0])) / max(1, k2[1] - k2[0])
    rest = call_us - (max(k1[1], k2[1]) - min(k1[0], k2[0])) / 1e3
    print(
        f"{sms[0]:>4} {sms[1]:>4} | {call_us:8.1f} {call_us / fused_us:7.3f} | {k1_us:7.1f} {k2_us:7.1f} "
        f"{overlap:8.0%} {rest:8.1f} | {same}"
    )
    layer.close()
