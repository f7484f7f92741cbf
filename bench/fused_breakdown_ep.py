"""Where a fused call's time goes across ranks: unfused and fused bracketed on every rank,
then one traced fused call per rank (fused.TRACE_EVENTS, µs from that rank's first block).

    megamoe-rt launch -n 2 bench/fused_breakdown_ep.py flash 8192 [local]

With `local`, every rank routes its tokens to its own experts only: the same work per rank
with no NVLink traffic, which separates the cost of the cross-rank protocol from the cost of
moving rows and partials.

Each rank owns the preset's EP8 slice of experts (as in `megamoe_rt.cli.bench moe` across ranks),
so a rank's work matches the one-GPU `bench/fused_breakdown.py` of the same preset.
"""

from __future__ import annotations

import sys

import cupy as cp

from megamoe_rt import MegaMoE
from megamoe_rt.cli.bench_ep import rank_inputs
from megamoe_rt.cli.benchmarks import fused_trace, print_fused_trace
from megamoe_rt.cli.timing import DeviceTimer, bracketed, capture_layer_call
from megamoe_rt.ep.launch import context_from_env
from megamoe_rt.ep.symm import NvshmemRuntime
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset
from megamoe_rt.testing import fused_schedule_of


def main(preset: str, tokens: int, routing: str = "uniform") -> None:
    if routing not in ("uniform", "local"):
        raise ValueError(f"routing: expected 'uniform' or 'local', got {routing!r}")
    ctx = context_from_env()
    cp.cuda.Device(ctx.device).use()
    p = get_preset(preset)
    local = p.num_experts // DEFAULT_EP_RANKS
    experts = local * ctx.world_size
    args, weights = rank_inputs(cp, ctx.rank, tokens, p.hidden, p.intermediate, experts, local, p.num_topk, tokens)
    if routing == "local":
        logits = cp.random.RandomState(tokens + ctx.rank).standard_normal((tokens, local), dtype=cp.float32)
        own = cp.argsort(-logits, axis=1)[:, : p.num_topk].astype(cp.int32) + ctx.rank * local
        args = (*args[:2], own, args[3])
    stream = cp.cuda.Stream(non_blocking=True)
    layers, arms = {}, {}
    for mode in ("unfused", "fused"):
        layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, tokens, mode=mode, group=ctx)
        layer.load_weights(*weights)
        y = cp.empty((tokens, p.hidden), cp.uint16)
        graph = capture_layer_call(layer, args, y, stream)
        layers[mode], arms[mode] = layer, (lambda g=graph: g.launch(stream=stream))
    with stream:
        results = bracketed(DeviceTimer(), arms, rounds=1)
    pairs = tokens * p.num_topk
    lines = [
        f"rank {ctx.rank} {preset} T={tokens}/rank EP{ctx.world_size} {routing} {m:>8}: {r.median_us:8.1f} us  "
        f"{layers[m].flops(pairs) / r.median_us / 1e6:7.1f} TFLOP/s"
        for m, r in results.items()
    ]
    ctx.barrier()
    events = fused_trace(layers["fused"], args, stream)
    ctx.barrier()
    for r in range(ctx.world_size):
        if r == ctx.rank:
            print("\n".join(lines), flush=True)
            print_fused_trace(f"rank {r} fused trace ({fused_schedule_of(layers['fused'])})", events)
            sys.stdout.flush()
        ctx.barrier()
    for layer in layers.values():
        layer.close()
    NvshmemRuntime.initialize(ctx).finalize()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
