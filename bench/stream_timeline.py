"""Where a streamed call's time goes: CUDA events after each of its launches, on the layer's
stream (consumer, seal, both GEMMs, combine) and on the router's (each chunk), with calls
enqueued back to back as `megamoe-rt bench stream` times them; then the router alone.

    python bench/stream_timeline.py flash 8192 [chunk 512] [slots 4]

Prints microseconds from the first call's start on the GPU, and the host time of each call's
`consume()` and `produce()` (the host runs ahead of the GPU when their sum is below the call).
"""

from __future__ import annotations

import sys
import time

import cupy as cp
import numpy as np

from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs
from megamoe_rt.kernels import moe as mk
from megamoe_rt.layer import MegaMoE
from megamoe_rt.routers import Router
from megamoe_rt.schedule.streaming import StreamConfig

# Keeps the GPU busy while the host enqueues the timed work, so the events time the device only.
SPIN = r"""extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""


def main(preset: str, tokens: int, chunk: int = 512, slots: int = 4, calls: int = 4) -> None:
    ((name, p, local, experts, t),) = preset_slices([preset], [tokens], 1)
    cfg = StreamConfig(num_slots=slots, tokens_per_slot=min(chunk, t))
    _, weights = rank_inputs(cp, 0, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
    hidden = cp.random.RandomState(7).standard_normal((t, p.hidden), dtype=cp.float32)
    gate = cp.random.RandomState(t).standard_normal((p.hidden, experts), dtype=cp.float32) / 64
    layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, streaming=cfg)
    layer.load_weights(*weights)
    router = Router(experts, p.num_topk, layer)
    main_stream, producer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    router.warm(hidden, gate, producer)
    fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
    y = cp.empty((t, p.hidden), dtype=cp.uint16)
    marks: list[tuple[str, cp.cuda.Event]] = []

    def mark(label: str, stream: cp.cuda.Stream) -> None:
        ev = cp.cuda.Event()
        ev.record(stream)
        marks.append((label, ev))

    # Events after the launches of the layer's side and the router's chunks.
    mode = layer.runner
    pool = mode._stream_pool
    pool.load_kernels()

    class Marked:
        def __init__(self, kernel, label):
            self.kernel, self.label = kernel, label

        def launch(self, grid, block, args, stream, **kw):
            self.kernel.launch(grid, block, args, stream=stream, **kw)
            mark(self.label, cp.cuda.ExternalStream(stream))

    for key in ("consume", "seal"):
        pool._kernels[key] = Marked(pool._kernels[key], key)
    combine = mk.launch_combine

    def marked_combine(kernels, params, grid, launches):
        combine(kernels, params, grid, launches)
        mark("combine", cp.cuda.ExternalStream(launches.stream))

    mk.launch_combine = marked_combine
    for i, g in enumerate(mode.gemms):

        def run(stream, block_map, run=g.run_block_mapped, label=f"L{i + 1} GEMM"):
            run(stream, block_map)
            mark(label, cp.cuda.ExternalStream(stream))

        g.run_block_mapped = run
    produce_chunks = router._produce_chunks

    def marked_launch(grid, block, args):
        produce_chunks(grid, block, args)
        first, count = int(args[4]), grid[2]
        mark(f"chunks {first}-{first + count - 1} published", cp.cuda.get_current_stream())

    router._produce_chunks = marked_launch

    def call() -> tuple[float, float]:
        with main_stream:
            h0 = time.perf_counter()
            fork.record(main_stream)
            producer.wait_event(fork)
            layer.consume(t, out=y, stream=main_stream, num_tokens_bound=t)
            h1 = time.perf_counter()
            router.produce(hidden, gate, producer)
            join.record(producer)
            main_stream.wait_event(join)
            return h1 - h0, time.perf_counter() - h1

    call()
    main_stream.synchronize()
    marks.clear()
    start = cp.cuda.Event()
    start.record(main_stream)
    host = []
    for i in range(calls):
        mark(f"call {i} start", main_stream)
        host.append(call())
    main_stream.synchronize()
    print(f"{name} T={t}, chunks of {cfg.tokens_per_slot}, {slots} slots, {calls} calls back to back")
    print("host us per call (consume, produce):", [(round(a * 1e6), round(b * 1e6)) for a, b in host])
    keep = ("start", "consume", "seal", "GEMM", "combine", "published")
    for label, ev in marks:
        if any(k in label + " " for k in keep):
            print(f"  {label:>22}: {cp.cuda.get_elapsed_time(start, ev) * 1000:9.1f} us")

    spin = cp.RawKernel(SPIN, "spin")
    for rows in (t, cfg.tokens_per_slot):
        with producer:
            router.route_batch(hidden[:rows], gate)
            spin((1,), (1,), (np.uint64(3_000_000),))
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(producer)
            for _ in range(10):
                router.route_batch(hidden[:rows], gate)
            b.record(producer)
        b.synchronize()
        print(f"router alone, {rows} tokens in one launch: {cp.cuda.get_elapsed_time(a, b) * 100:.1f} us (device)")
    layer.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *(int(a) for a in sys.argv[3:]))
