"""``megamoe-rt bench stream``: a router and the layer end to end, streamed against sequential.

Sequential is what a pipeline does without the input ring: the gating GEMM and the routing of
every token, the activations quantized, then the layer's call (unfused, the streamed call's
path; fused as well, for reference). Streamed: the layer's call is enqueued first on its stream
and consumes chunks while the router (megamoe_rt/routers.py) produces them on another stream,
chunk by chunk. Both arms are timed between CUDA events on the timer's stream (the producer
stream forks from it and joins it), so each covers router and layer. Target (docs/STREAMING.md):
streamed faster than sequential at >= 2048 tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from megamoe_rt.cli.timing import DeviceTimer, bracketed

TOKENS = [512, 2048, 8192]
PRESETS = ["flash", "v3"]


def bench_stream(
    presets: list[str],
    tokens: list[int],
    *,
    slots: int = 4,
    chunk: int = 512,
    rounds: int = 3,
    json_path: str | None = None,
) -> list[dict]:
    from megamoe_rt.cli.layer_inputs import preset_slices

    rows = []
    for name, p, _, experts, t in preset_slices(presets, tokens, 1):
        rows += _bench_cell(name, p, experts, t, slots=slots, chunk=chunk, rounds=rounds)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


def _bench_cell(name: str, p: Any, experts: int, t: int, *, slots: int, chunk: int, rounds: int) -> list[dict]:
    import cupy as cp

    from megamoe_rt.cli.layer_inputs import rank_inputs
    from megamoe_rt.kernels.quantize import quantize_fp8
    from megamoe_rt.layer import MegaMoE
    from megamoe_rt.routers import Router
    from megamoe_rt.streaming import StreamConfig

    _, weights = rank_inputs(cp, 0, t, p.hidden, p.intermediate, experts, experts, p.num_topk, t)
    rs = cp.random.RandomState(t)
    hidden = rs.standard_normal((t, p.hidden), dtype=cp.float32)
    gate = rs.standard_normal((p.hidden, experts), dtype=cp.float32) / 64
    chunk = min(chunk, t)  # a chunk runs as a call of at most the layer's capacity (t)
    cfg = StreamConfig(num_slots=slots, tokens_per_slot=chunk)
    streamed = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, streaming=cfg)
    layers = {m: MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, mode=m) for m in ("unfused", "fused")}
    for layer in (streamed, *layers.values()):
        layer.load_weights(*weights)
    router = Router(experts, p.num_topk, streamed)
    idx = cp.empty((t, p.num_topk), cp.int32)
    w = cp.empty((t, p.num_topk), cp.float32)
    y = cp.empty((t, p.hidden), dtype=cp.uint16)
    producer = cp.cuda.Stream(non_blocking=True)
    router.warm(hidden, gate, producer)
    fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

    def sequential(layer: Any) -> None:
        router.route_all(hidden @ gate, idx, w)
        x, x_sf = quantize_fp8(hidden)
        layer(x, x_sf, idx, w, out=y)

    def streamed_call() -> None:
        main = cp.cuda.get_current_stream()
        fork.record(main)
        producer.wait_event(fork)
        streamed.consume(t, out=y, stream=main)
        router.produce(hidden, gate, producer)
        join.record(producer)
        main.wait_event(join)

    arms: dict[str, Callable[[], None]] = {
        f"sequential {m}": functools.partial(sequential, layer) for m, layer in layers.items()
    }
    arms["streamed"] = streamed_call
    results = bracketed(DeviceTimer(calls=10), arms, rounds=rounds)
    same = _streamed_is_sequential(cp, streamed, layers["unfused"], router, hidden, gate, producer)
    base = results["sequential unfused"].median_us
    rows = []
    for arm, r in results.items():
        row = {
            "preset": name,
            "tokens": t,
            "arm": arm,
            "slots": slots,
            "tokens_per_slot": chunk,
            "chunks": cfg.num_chunks(t),
            "median_us": r.median_us,
            "band_us": list(r.band_us),
            "vs_sequential_unfused": r.median_us / base,
            "streamed_equals_sequential": same,
            "error": r.error,
        }
        rows.append(row)
        print(
            f"{name:>5} T={t:<5} {arm:>18}: {r.median_us:9.1f} us  x{row['vs_sequential_unfused']:.3f} of "
            f"sequential unfused  ({cfg.num_chunks(t)} chunks of {chunk}, {slots} slots)",
            flush=True,
        )
    for layer in (streamed, *layers.values()):
        layer.close()
    cp.get_default_memory_pool().free_all_blocks()
    if not same:
        raise AssertionError(f"{name} T={t}: the streamed call's output differs from the sequential call's")
    return rows


def _streamed_is_sequential(
    cp: Any, streamed: Any, batch: Any, router: Any, hidden: Any, gate: Any, producer: Any
) -> bool:
    """One streamed call against the batch call routed from the same logits, bitwise (the timed
    sequential arm multiplies all tokens at once, which cuBLAS may round differently per shape)."""
    from megamoe_rt.kernels.quantize import quantize_fp8

    t, k = hidden.shape[0], router.num_topk
    y = streamed.consume(t)
    logits = cp.concatenate(router.produce(hidden, gate, producer))
    cp.cuda.Device().synchronize()
    idx, w = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32)
    router.route_all(logits, idx, w)
    x, x_sf = quantize_fp8(hidden)
    same = bool(cp.array_equal(y, batch(x, x_sf, idx, w)))
    cp.cuda.Device().synchronize()
    return same
