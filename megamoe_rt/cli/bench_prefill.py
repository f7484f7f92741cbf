"""``megamoe-rt bench prefill``: time and buffer memory of long calls against the ring size.

For every (preset, tokens) cell and mode, one layer per ring size (the full worst-case pool,
then shares of it through ``chunk_ratio``; the fused mode also at its default ring), each call
captured in a CUDA graph and the replays of one mode bracketed in rounds (cli/timing.py), so a
ring's time is read against the same mode's full pool measured alongside it.

Across launched ranks (``megamoe-rt launch -n 2 -m megamoe_rt.cli.bench prefill ...``) each
rank calls with ``tokens`` tokens against the preset's EP8 per-rank slice of experts, routing
uniform over all ranks' experts; the worst-case pool grows with the rank count, which is what
a ring saves. Every rank measures; a ring's time is the slowest rank's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs
from megamoe_rt.cli.output import write_json
from megamoe_rt.cli.timing import (
    DeviceTimer,
    arm_times,
    bracketed,
    capture_layer_call,
    every_rank,
    slowest_rank,
)
from megamoe_rt.ep.group import RankGroup
from megamoe_rt.modes.base import POOL_REGIONS, LayerSpec
from megamoe_rt.modes.registry import MODES as MODE_CLASSES
from megamoe_rt.modes.registry import mode_names

FULL = 1.0
DEFAULT_RING = "default"  # a mode's own ring (the fused schedule's: its lag window)
MODES = list(mode_names())  # the default: every mode
RATIOS = [0.5, 0.25, 0.125]
WINDOWS = [16384]  # token windows (token_window): the whole buffer sized for this many tokens
TOKENS = [16384, 32768, 65536, 131072]  # per call on one GPU
EP_TOKENS = [16384, 32768]  # per rank across ranks: the full pool of R ranks is R times one GPU's


def _rings(mode: str, ratios: list[float], spec: LayerSpec, windows: Sequence[int] = ()) -> list[str]:
    """The arms of a cell, by key: the full pool, the shares of it, the mode's own ring where
    its buffer is a ring unless told otherwise (the fused mode's), and each token window shorter
    than the call (``window W``)."""
    rings: list[str] = [str(r) for r in (FULL, *[r for r in ratios if r != FULL])]
    if MODE_CLASSES[mode].layout_needs(spec).pool == "ring":
        rings.append(DEFAULT_RING)
    return rings + [f"window {w}" for w in windows if w < spec.num_max_tokens_per_rank]


def _layer_kwargs(ring: str) -> dict[str, Any]:
    if ring == DEFAULT_RING:
        return {}
    if ring.startswith("window "):
        return {"token_window": int(ring.split()[1])}
    return {"chunk_ratio": float(ring)}


@dataclass(frozen=True)
class RingSize:
    """What a ring's layer holds: pool slots, pool bytes (POOL_REGIONS) and the whole buffer's bytes."""

    blocks: int
    pool_bytes: int
    buffer_bytes: int

    @classmethod
    def of(cls, layer: Any) -> RingSize:
        layout = layer.layout
        return cls(layout.pool_blocks, sum(layout.region(n).nbytes for n in POOL_REGIONS), layout.total_bytes)


def prefill_rows(
    preset: str, tokens: int, mode: str, sizes: dict[str, RingSize], everyone: list[dict[str, dict]]
) -> list[dict]:
    """The rows of one (preset, tokens, mode) cell, a ring per row, from every rank's times
    (``arm_times`` per ring key; one rank on one GPU). A call across ranks ends with its slowest
    rank, so a ring's time (and band) is the slowest rank's, its ratio against the slowest
    rank's at the full pool. The layouts are the same on every rank."""
    full = sizes[str(FULL)]
    full_us = slowest_rank(everyone, str(FULL))["median_us"]
    rows = []
    for key, size in sizes.items():
        res = slowest_rank(everyone, key)
        rows.append(
            {
                "preset": preset,
                "tokens": tokens,
                "ranks": len(everyone),
                "mode": mode,
                "ring": key,
                "ring_blocks": size.blocks,
                "full_pool_blocks": full.blocks,
                "median_us": res["median_us"],
                "median_us_per_rank": [e[key]["median_us"] for e in everyone],
                "band_us": res["band_us"],
                "rounds_us": res["rounds_us"],
                "time_vs_full": res["median_us"] / full_us,
                "pool_mib": size.pool_bytes / 2**20,
                "buffer_mib": size.buffer_bytes / 2**20,
                "pool_vs_full": size.pool_bytes / full.pool_bytes,
                "buffer_vs_full": size.buffer_bytes / full.buffer_bytes,
            }
        )
    return rows


def format_row(row: dict) -> str:
    ranks = f" EP{row['ranks']}" if row["ranks"] > 1 else ""
    return (
        f"{row['preset']:>5} T={row['tokens']:<6}{ranks} {row['mode']:>8} ring {row['ring']:>7} "
        f"({row['ring_blocks']:>6}/{row['full_pool_blocks']} blocks): {row['median_us']:10.1f} us "
        f"x{row['time_vs_full']:.3f}  pool {row['pool_mib']:8.1f} MiB (1/{1 / row['pool_vs_full']:.1f})  "
        f"buffer {row['buffer_mib']:8.1f} MiB (1/{1 / row['buffer_vs_full']:.2f})"
    )


def bench_prefill(
    presets: list[str],
    tokens: list[int],
    *,
    modes: list[str],
    ratios: list[float],
    windows: Sequence[int] = (),
    rounds: int = 2,
    group: RankGroup | None = None,
    json_path: str | None = None,
    png_path: str | None = None,
) -> list[dict]:
    """Rows of (preset, tokens, mode, ring): device time, its ratio to the mode's full pool,
    pool and buffer MiB and their ratio to the full pool's (``prefill_rows``); ``windows`` adds a
    row per token window (``token_window``: the whole buffer sized for the window). With ``group``
    (launched ranks) every rank builds, calls and closes the same layers in the same order
    (each a collective) and rank 0 prints and writes the files."""
    import cupy as cp

    from megamoe_rt.layer import MegaMoE

    world = 1 if group is None else group.world_size
    rank = 0 if group is None else group.rank
    # Long calls: fewer calls per observation than the short-call benchmarks need.
    timer = DeviceTimer(calls=6, observations=2)
    rows: list[dict] = []
    for name, p, local, experts, t in preset_slices(presets, tokens, world):
        args, weights = rank_inputs(cp, rank, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
        stream = cp.cuda.Stream(non_blocking=True)
        spec = LayerSpec(p.hidden, p.intermediate, experts, p.num_topk, t, num_ranks=world)
        for mode in modes:
            layers: dict[str, Any] = {}
            arms: dict[str, Callable[[], None]] = {}
            for ring in _rings(mode, ratios, spec, list(windows)):
                layer = MegaMoE(
                    p.hidden, p.intermediate, experts, p.num_topk, t, mode=mode, group=group, **_layer_kwargs(ring)
                )
                layer.load_weights(*weights, stream=stream)
                y = cp.empty((t, p.hidden), dtype=cp.uint16)
                graph = capture_layer_call(layer, args, y, stream, num_tokens_bound=t)
                layers[ring] = (layer, graph, y)
                arms[ring] = functools.partial(graph.launch, stream=stream)
            with stream:
                results = bracketed(timer, arms, rounds=rounds)
            mine = {key: arm_times(res) for key, res in results.items()}
            sizes = {key: RingSize.of(layer) for key, (layer, _, _) in layers.items()}
            cell = prefill_rows(name, t, mode, sizes, every_rank(group, mine, key="bench-prefill"))
            rows.extend(cell)
            if rank == 0:
                for row in cell:
                    print(format_row(row), flush=True)
                if json_path:  # after every cell: a long run cut short keeps what it measured
                    write_json(json_path, rows)
            if group is not None:
                group.barrier()  # no rank frees its buffers while a peer's last call may still read them
            for layer, _, _ in layers.values():
                layer.close()
            del layers, arms
            cp.get_default_memory_pool().free_all_blocks()
        del args, weights
        cp.get_default_memory_pool().free_all_blocks()
    if png_path and rank == 0:
        from megamoe_rt.cli.plotting import prefill_chart

        prefill_chart(rows, png_path)  # a bar per row: time against the same mode's full pool; a line at +5%
    return rows
