"""One streamed call of the fused mode with a 3 s deadline and a stage trace: prints the deadline
report if a wait traps, else whether the output is the batch call's.

    python3 bench/stream_diag.py TOKENS SLOTS TOKENS_PER_SLOT [coop|nocoop|PRODUCER_SMS|prodfirst]

coop / nocoop force the launch's cooperative attribute; a number sets StreamConfig.producer_sms;
prodfirst enqueues the ChunkWriter before the layer's call (a call of at most SLOTS chunks)."""

import sys

import cupy as cp
import numpy as np
from cuda.bindings import driver as cu

from megamoe_rt import MegaMoE
from megamoe_rt import reference as ref
from megamoe_rt.kernels.fused import TRACE_EVENTS
from megamoe_rt.runtime import driver
from megamoe_rt.streaming import ChunkWriter, StreamConfig
from megamoe_rt.testing import trace_buffer

H, I, E, K = 512, 256, 16, 4
t, slots, tps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
how = sys.argv[4] if len(sys.argv) > 4 else ""
psms = int(how) if how.isdigit() else None
rng = np.random.default_rng(0)
w = ref.random_moe_inputs(rng, 1, H, I, E, K)
layer = MegaMoE(H, I, E, K, 2048, streaming=StreamConfig(slots, tps, producer_sms=psms), mode="fused", timeout_s=3.0)
layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
if how in ("nocoop", "coop"):
    k = layer.runner.plan.kernel("int32", "streamed")
    orig = k.launch

    def launch(*a, **kw):
        kw["cooperative"] = how == "coop"
        return orig(*a, **kw)

    k.launch = launch
inp = ref.random_moe_inputs(rng, t, H, I, E, K)
args = [cp.asarray(inp[n].view(np.uint8) if n == "x" else inp[n]) for n in ("x", "x_sf", "topk_idx", "topk_weights")]
print(
    "how",
    how,
    "grid",
    layer.runner.streamed.grid,
    "lag",
    layer.runner.streamed.lag,
    "blocks",
    layer.layout.full_pool_blocks,
)
producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
cp.cuda.Device().synchronize()
out = cp.zeros((t, H), cp.uint16)
with trace_buffer(layer) as stamps:
    writer = ChunkWriter(layer)
    if how == "prodfirst":
        writer.write_all(*args, stream=producer)
        layer.consume(t, out=out, stream=consumer)
    else:
        layer.consume(t, out=out, stream=consumer)
        writer.write_all(*args, stream=producer)
    try:
        driver.call(cu.cuCtxSynchronize)
    except driver.CudaError as err:
        print("TRAP:", err)
        sys.exit(3)
    host = cp.asnumpy(stamps)
col = {e: j for j, e in enumerate(TRACE_EVENTS)}
ran = host[host[:, col["start"]] != 0]
print("blocks ran", len(ran), "first_l1 set", int((ran[:, col["first_l1"]] != 0).sum()))
batch = MegaMoE(H, I, E, K, 2048, mode="unfused")
batch.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
want = cp.asnumpy(batch(*args))
print("equal", np.array_equal(cp.asnumpy(out), want), "nan", int(np.isnan(cp.asnumpy(out).view(np.float16)).sum()))
