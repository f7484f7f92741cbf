"""A long prompt through one MoE layer with a small ring: the memory it saves and what it costs.

The layer's expert pools normally hold the worst-case pool (every token routed here); with
``chunk_ratio`` they hold a share of it and the call runs in cycles (unfused) or reuses ring
slots as soon as they are read (fused, split). The output is the same, bit for bit. Run on a
Hopper GPU:

    python examples/prefill.py [--preset flash] [--tokens 32768] [--mode unfused] [--ratio 0.25]
"""

import argparse

import numpy as np

from megamoe_rt import MegaMoE, quantize_fp8, quantize_weight_fp8, require_gpu
from megamoe_rt.cli.timing import capture_layer_call
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="flash")
ap.add_argument("--tokens", type=int, default=32768)
ap.add_argument("--mode", default="unfused", choices=("unfused", "fused", "split"))
ap.add_argument("--ratio", type=float, default=0.25, help="the ring as a share of the worst-case pool")
a = ap.parse_args()

# Before CuPy is imported: without the cu13 extra or a Hopper GPU, one line says what is missing.
require_gpu()

import cupy as cp

p = get_preset(a.preset)
experts, t, topk = p.num_experts // DEFAULT_EP_RANKS, a.tokens, p.num_topk  # one rank's EP8 slice
rs = cp.random.RandomState(0)
x, x_sf = quantize_fp8(rs.standard_normal((t, p.hidden), dtype=cp.float32))
topk_idx = cp.argsort(rs.standard_normal((t, experts)), axis=1)[:, :topk].astype(cp.int32)
topk_weights = cp.full((t, topk), 1.0 / topk, dtype=cp.float32)
w1, w1_sf = quantize_weight_fp8(rs.standard_normal((experts, 2 * p.intermediate, p.hidden), dtype=cp.float32) / 64)
w2, w2_sf = quantize_weight_fp8(rs.standard_normal((experts, p.hidden, p.intermediate), dtype=cp.float32) / 64)
args = (x, x_sf, topk_idx, topk_weights)
# The calls run on their own stream: the inputs above (made on CuPy's current stream) must be
# complete first, and load_weights runs on the calls' stream so they see the weights.
cp.cuda.get_current_stream().synchronize()
stream = cp.cuda.Stream(non_blocking=True)


def run(layer, reps=5):
    """The output of one call and the median device time of its CUDA-graph replay, in ms."""
    y = cp.empty((t, p.hidden), dtype=cp.uint16)
    graph = capture_layer_call(layer, args, y, stream)  # an eager call (kernels load), then the call captured
    with stream:
        times = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
    return cp.asnumpy(y), float(np.median(times))


results = {}
for label, kwargs in (("full pool", {"chunk_ratio": 1.0}), (f"ring {a.ratio:g}", {"chunk_ratio": a.ratio})):
    layer = MegaMoE(p.hidden, p.intermediate, experts, topk, t, mode=a.mode, **kwargs)
    layer.load_weights(w1, w1_sf, w2, w2_sf, stream=stream)
    y, ms = run(layer)
    results[label] = (y, ms, layer.layout.total_bytes / 2**20)
    print(f"--- {a.mode}, {label}: {t} tokens of {a.preset} ({experts} local experts, top-{topk})")
    print(next(line for line in layer.memory_report().splitlines() if " pools: " in line))
    layer.close()

(y_full, ms_full, mib_full), (y_ring, ms_ring, mib_ring) = results.values()
print(f"\n{'':>12} {'buffer MiB':>11} {'time ms':>9}")
for label, (_, ms, mib) in results.items():
    print(f"{label:>12} {mib:11.1f} {ms:9.3f}")
print(f"buffer x{mib_full / mib_ring:.2f} smaller, time x{ms_ring / ms_full:.3f}")
print("bitwise equal:", bool(np.array_equal(y_full, y_ring)))
