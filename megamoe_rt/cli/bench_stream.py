"""``megamoe-rt bench stream``: a router and the layer end to end, streamed against sequential.

Sequential is what a pipeline does without the input ring: the same router over every token at
once (its gating product, routing and quantized activations in one launch,
``Router.route_batch``), then the layer's call, in the default mode (``sequential fused``: the
arm a streamed call must beat) and in the baseline mode. Streamed: the layer's call (on one
GPU the fused kernel's streamed role, ``mode="fused"``, and beside it, as ``streamed unfused``,
the unfused mode's call-wide pool; across ranks the unfused mode's chunk calls) is enqueued
first on its stream and consumes chunks while the
router (megamoe_rt/routers.py) produces them on another stream, a round of the ring per launch,
each chunk published as soon as it is done. Every arm is timed between CUDA events on the
timer's stream (the producer stream forks from it and joins it), so each covers router and
layer. Target (issue [stream2]): streamed at <= 0.97x of sequential fused at 512 and 2048
tokens, <= 1.0x at 8192.

Across launched ranks (``megamoe-rt launch -n 2 -m megamoe_rt.cli.bench stream ...``) each rank
routes its own ``tokens`` tokens over every rank's experts (the preset's EP8 per-rank slice on
each rank) and every rank measures; an arm's time is the slowest rank's. The streamed call is
checked against the batch call on every rank, and every rank raises if any rank's differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs
from megamoe_rt.cli.output import write_json
from megamoe_rt.cli.timing import DeviceTimer, arm_times, bracketed, every_rank, slowest_rank
from megamoe_rt.ep.group import RankGroup
from megamoe_rt.modes.registry import baseline_mode, default_mode
from megamoe_rt.schedule.streaming import StreamConfig

TOKENS = [512, 2048, 8192]
PRESETS = ["flash", "v3"]
# The sequential arms: the baseline mode, and the default mode (what a pipeline without the ring
# runs: the arm a streamed call is read against).
SEQUENTIAL = tuple(dict.fromkeys((baseline_mode(), default_mode())))
BASE = f"sequential {default_mode()}"
VS_BASE = f"vs_{BASE.replace(' ', '_')}"  # the rows' ratio to it


def bench_stream(
    presets: list[str],
    tokens: list[int],
    *,
    slots: int = 4,
    chunk: int = 512,
    producer_sms: int | None = None,
    rounds: int = 3,
    group: RankGroup | None = None,
    json_path: str | None = None,
) -> list[dict]:
    """Rows of (preset, tokens, arm) (``stream_rows``). With ``group`` (launched ranks) every rank
    builds, calls and closes the same layers in the same order (each a collective), rank 0
    prints and writes the file, and every rank raises alike when a rank's streamed call
    differed from its batch call."""
    world = 1 if group is None else group.world_size
    rank = 0 if group is None else group.rank
    rows: list[dict] = []
    for name, p, local, experts, t in preset_slices(presets, tokens, world):
        # A chunk runs as a call of at most the layer's capacity (t).
        cfg = StreamConfig(num_slots=slots, tokens_per_slot=min(chunk, t), producer_sms=producer_sms)
        everyone = _bench_cell(p, local, experts, t, cfg, rounds=rounds, group=group)
        cell = stream_rows(name, t, cfg, everyone)
        rows.extend(cell)
        if rank == 0:
            for row in cell:
                print(format_row(row), flush=True)
            if json_path:  # after every cell: a run cut short keeps what it measured
                write_json(json_path, rows)
        differ = [r for r, e in enumerate(everyone) if not e["same"]]
        if differ:  # every rank has every rank's check: all raise alike
            where = f" on rank(s) {differ}" if world > 1 else ""
            raise AssertionError(f"{name} T={t}: the streamed call's output differs from the sequential call's{where}")
    return rows


def stream_rows(preset: str, tokens: int, cfg: StreamConfig, everyone: list[dict]) -> list[dict]:
    """The rows of one (preset, tokens) cell, an arm per row, from every rank's ``{"arms": {arm:
    arm_times}, "same": bool}`` (one rank on one GPU). A call across ranks ends with its slowest
    rank, so an arm's time (and band) is the slowest rank's, its ratio against the slowest
    rank's time in the base arm (BASE)."""
    base = slowest_rank([e["arms"] for e in everyone], BASE)["median_us"]
    same = all(e["same"] for e in everyone)
    rows = []
    for arm in everyone[0]["arms"]:
        res = slowest_rank([e["arms"] for e in everyone], arm)
        rows.append(
            {
                "preset": preset,
                "tokens": tokens,
                "ranks": len(everyone),
                "arm": arm,
                "slots": cfg.num_slots,
                "tokens_per_slot": cfg.tokens_per_slot,
                "chunks": cfg.num_chunks(tokens),
                "producer_sms": cfg.producer_sms,
                "median_us": res["median_us"],
                "median_us_per_rank": [e["arms"][arm]["median_us"] for e in everyone],
                "band_us": res["band_us"],
                VS_BASE: res["median_us"] / base,
                "streamed_equals_sequential": same,
                "error": res.get("error"),
            }
        )
    return rows


def format_row(row: dict) -> str:
    ranks = f" EP{row['ranks']}" if row["ranks"] > 1 else ""
    slowest = ", slowest rank" if row["ranks"] > 1 else ""
    return (
        f"{row['preset']:>5} T={row['tokens']:<5}{ranks} {row['arm']:>18}: {row['median_us']:9.1f} us  "
        f"x{row[VS_BASE]:.3f} of {BASE}  ({row['chunks']} chunks of "
        f"{row['tokens_per_slot']}, {row['slots']} slots{slowest})"
    )


def _bench_cell(
    p: Any, local: int, experts: int, t: int, cfg: StreamConfig, *, rounds: int, group: RankGroup | None
) -> list[dict]:
    """Every rank's times of the three arms and whether its streamed call gave the batch call's
    bits (``every_rank``). The layers span the ranks (``group``): ``experts`` is every rank's,
    ``local`` this rank's."""
    import cupy as cp

    from megamoe_rt.layer import MegaMoE
    from megamoe_rt.routers import Router

    rank = 0 if group is None else group.rank
    _, weights = rank_inputs(cp, rank, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
    # Each rank's own tokens; one gate matrix over every rank's experts, the same on every rank.
    hidden = cp.random.RandomState(t * 1000 + rank).standard_normal((t, p.hidden), dtype=cp.float32)
    gate = cp.random.RandomState(t).standard_normal((p.hidden, experts), dtype=cp.float32) / 64
    # One GPU: the fused kernel's streamed role, and beside it the baseline mode's streamed call
    # (the call-wide pool, GEMMs after the seal); across ranks the default (unfused chunk calls).
    streamed_modes: dict[str, str | None] = {"streamed": default_mode() if group is None else None}
    if group is None and default_mode() != baseline_mode():
        streamed_modes[f"streamed {baseline_mode()}"] = baseline_mode()
    streamed = {
        arm: MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, streaming=cfg, group=group, mode=mode)
        for arm, mode in streamed_modes.items()
    }
    layers = {m: MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, mode=m, group=group) for m in SEQUENTIAL}
    for layer in (*streamed.values(), *layers.values()):
        layer.load_weights(*weights)
    routers = {arm: Router(experts, p.num_topk, layer) for arm, layer in streamed.items()}
    y = cp.empty((t, p.hidden), dtype=cp.uint16)
    producer = cp.cuda.Stream(non_blocking=True)
    for router in routers.values():
        router.warm(hidden, gate, producer)  # the producer's kernels loaded before any layer call waits
    fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

    def sequential(layer: Any) -> None:
        x, x_sf, idx, w, _ = routers["streamed"].route_batch(hidden, gate)  # every token in one launch
        layer(x, x_sf, idx, w, out=y, num_tokens_bound=t)

    def streamed_call(layer: Any, router: Any) -> None:
        main = cp.cuda.get_current_stream()
        fork.record(main)
        producer.wait_event(fork)
        layer.consume(t, out=y, stream=main, num_tokens_bound=t)
        router.produce(hidden, gate, producer)
        join.record(producer)
        main.wait_event(join)

    arms: dict[str, Callable[[], None]] = {
        f"sequential {m}": functools.partial(sequential, layer) for m, layer in layers.items()
    }
    for arm, layer in streamed.items():
        arms[arm] = functools.partial(streamed_call, layer, routers[arm])
    results = bracketed(DeviceTimer(calls=10), arms, rounds=rounds)
    same = all(
        _streamed_is_sequential(cp, layer, layers[SEQUENTIAL[0]], routers[arm], hidden, gate, producer)
        for arm, layer in streamed.items()
    )
    mine = {"arms": {arm: arm_times(res) for arm, res in results.items()}, "same": same}
    everyone = every_rank(group, mine, key="bench-stream")
    if group is not None:
        group.barrier()  # no rank frees its buffers while a peer's last call may still read them
    for layer in (*streamed.values(), *layers.values()):
        layer.close()
    cp.get_default_memory_pool().free_all_blocks()
    return everyone


def _streamed_is_sequential(
    cp: Any, streamed: Any, batch: Any, router: Any, hidden: Any, gate: Any, producer: Any
) -> bool:
    """One streamed call against the batch call routed by the same router over every token at
    once, bitwise (the router gives a token the same logits in a chunk and in the whole call).
    Across ranks both calls are collectives, made in this order on every rank."""
    t = hidden.shape[0]
    y = streamed.consume(t, num_tokens_bound=t)
    chunk_logits = cp.concatenate(router.produce(hidden, gate, producer))
    cp.cuda.Device().synchronize()
    x, x_sf, idx, w, logits = router.route_batch(hidden, gate)
    same = bool(cp.array_equal(y, batch(x, x_sf, idx, w, num_tokens_bound=t))) and bool(
        cp.array_equal(chunk_logits, logits)
    )
    cp.cuda.Device().synchronize()
    return same
