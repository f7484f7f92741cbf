"""One streamed call of the fused mode with a 3 s deadline and a stage trace: prints the deadline
report if a wait traps, else whether the output is the batch call's.

    python3 bench/stream_diag.py TOKENS SLOTS TOKENS_PER_SLOT [coop|nocoop|PRODUCER_SMS|prodfirst|probe|warm]

coop / nocoop force the launch's cooperative attribute; a number sets StreamConfig.producer_sms;
prodfirst enqueues the ChunkWriter before the layer's call (a call of at most SLOTS chunks);
probe records an event after each producer step of chunk 0 and reports which completed while
the layer waits; warm runs one prodfirst call before the consumer-first one. MODE=unfused
runs the same against the unfused mode."""

import contextlib
import os
import sys
import time

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
layer = MegaMoE(
    H,
    I,
    E,
    K,
    2048,
    streaming=StreamConfig(slots, tps, producer_sms=psms),
    mode=os.environ.get("MODE", "fused"),
    timeout_s=3.0,
)
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
streamed = getattr(layer.runner, "streamed", None)  # the fused mode's streamed call
shape = f"grid {streamed.grid} lag {streamed.lag}" if streamed is not None else "unfused"
print("how", how, shape, "blocks", layer.layout.full_pool_blocks)
producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)


def local_bytes(kernel):
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
    return int(driver.call(cu.cuFuncGetAttribute, attr, kernel.function))


layer.input_ring.load_kernels()
lmem = {n: local_bytes(k) for n, k in layer.input_ring._kernels.items()}
if os.environ.get("MODE", "fused") == "fused":
    lmem["fused streamed"] = local_bytes(layer.runner.plan.kernel("int32", "streamed"))
stack = int(driver.call(cu.cuCtxGetLimit, cu.CUlimit.CU_LIMIT_STACK_SIZE))
print("local bytes per thread:", lmem, "stack limit", stack, flush=True)
cp.cuda.Device().synchronize()
out = cp.zeros((t, H), cp.uint16)
with trace_buffer(layer) if streamed is not None else contextlib.nullcontext() as stamps:
    writer = ChunkWriter(layer)
    if how == "warm":
        # one whole call with the producer enqueued first, then the consumer-first order below
        writer.write_all(*args, stream=producer)
        layer.consume(t, out=out, stream=consumer)
        driver.call(cu.cuCtxSynchronize)
        out.fill(0xFFFF)
        print("warm call done", flush=True)
    t0 = time.perf_counter()
    if how == "probe":
        # Where does the producer stop? An event after each of its steps on chunk 0, polled.
        from megamoe_rt.runtime import streams

        layer.consume(t, out=out, stream=consumer)
        t1 = time.perf_counter()
        ring, sh = layer.input_ring, producer.ptr
        marks = []

        def mark(name):
            marks.append((name, streams.Event(timing=False).record(sh)))
            print(f"  {name} enqueued at {1e3 * (time.perf_counter() - t1):.1f} ms", flush=True)

        mark("start")
        writer.begin_call(stream=producer)
        mark("begin_call")
        inputs, _ = writer._inputs(*args, sh)
        params = ring.params(0, num_tokens=t, **inputs)
        ring._launch("stream_wait_slot_free", params, sh)
        mark("wait_slot_free")
        ring._launch("stream_copy_chunk", params, sh, 64)
        mark("copy")
        ring._launch("stream_publish_chunk", params, sh)
        mark("publish")
        with producer:
            cp.arange(1024, dtype=cp.float32).sum()
        mark("cupy kernel")
        for c in range(1, slots and -(-t // tps)):
            writer.write(c, *args, stream=producer)
        t2 = time.perf_counter()
        for _ in range(15):
            time.sleep(0.1)
        print("producer marks after 1.5 s:", [(n, e.done) for n, e in marks], flush=True)
    elif how == "prodfirst":
        writer.write_all(*args, stream=producer)
        t1 = time.perf_counter()
        layer.consume(t, out=out, stream=consumer)
    else:
        layer.consume(t, out=out, stream=consumer)
        t1 = time.perf_counter()
        writer.write_all(*args, stream=producer)
    t2 = time.perf_counter()
    # a first enqueue that blocks the host for about the deadline waited for the GPU (a context sync)
    print(f"host: first enqueue {1e3 * (t1 - t0):.1f} ms, second {1e3 * (t2 - t1):.1f} ms", flush=True)
    try:
        driver.call(cu.cuCtxSynchronize)
    except driver.CudaError as err:
        print("TRAP:", err)
        sys.exit(3)
    host = cp.asnumpy(stamps) if stamps is not None else None
if host is not None:
    col = {e: j for j, e in enumerate(TRACE_EVENTS)}
    ran = host[host[:, col["start"]] != 0]
    print("blocks ran", len(ran), "first_l1 set", int((ran[:, col["first_l1"]] != 0).sum()))
batch = MegaMoE(H, I, E, K, 2048, mode="unfused")
batch.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
want = cp.asnumpy(batch(*args))
print("equal", np.array_equal(cp.asnumpy(out), want), "nan", int(np.isnan(cp.asnumpy(out).view(np.float16)).sum()))
