"""``megamoe-rt bench prefill``: time and buffer memory of long calls against the ring size.

For every (preset, tokens) cell and mode, one layer per ring size (the full worst-case pool,
then shares of it through ``chunk_ratio``; the fused mode also at its default ring), each call
captured in a CUDA graph and the replays of one mode bracketed in rounds (cli/timing.py), so a
ring's time is read against the same mode's full pool measured alongside it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from megamoe_rt.cli.timing import DeviceTimer, bracketed, capture_layer_call
from megamoe_rt.modes.base import POOL_REGIONS
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset

FULL = 1.0
DEFAULT_RING = "default"  # the fused schedule's own ring (its lag window)


def _rings(mode: str, ratios: list[float]) -> list[float | str]:
    rings: list[float | str] = [FULL, *[r for r in ratios if r != FULL]]
    return [*rings, DEFAULT_RING] if mode == "fused" else rings


def _layer_kwargs(ring: float | str) -> dict[str, Any]:
    return {} if ring == DEFAULT_RING else {"chunk_ratio": ring}


def bench_prefill(
    presets: list[str],
    tokens: list[int],
    *,
    modes: list[str],
    ratios: list[float],
    rounds: int = 2,
    json_path: str | None = None,
    png_path: str | None = None,
) -> list[dict]:
    """Rows of (preset, tokens, mode, ring): device time, its ratio to the mode's full pool,
    pool and buffer MiB and their ratio to the full pool's."""
    import cupy as cp

    from megamoe_rt.cli.demo import random_layer_inputs
    from megamoe_rt.layer import MegaMoE

    # Long calls: fewer calls per observation than the short-call benchmarks need.
    timer = DeviceTimer(calls=6, observations=2)
    rows: list[dict] = []
    for name in presets:
        p = get_preset(name)
        experts = p.num_experts // DEFAULT_EP_RANKS
        for t in tokens:
            inp = random_layer_inputs(cp, t, p.hidden, p.intermediate, experts, p.num_topk, seed=t)
            args = (inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"])
            stream = cp.cuda.Stream(non_blocking=True)
            for mode in modes:
                layers: dict[str, Any] = {}
                arms: dict[str, Callable[[], None]] = {}
                for ring in _rings(mode, ratios):
                    layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, mode=mode, **_layer_kwargs(ring))
                    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"], stream=stream)
                    y = cp.empty((t, p.hidden), dtype=cp.uint16)
                    graph = capture_layer_call(layer, args, y, stream, num_tokens_bound=t)
                    layers[str(ring)] = (layer, graph, y)
                    arms[str(ring)] = functools.partial(graph.launch, stream=stream)
                with stream:
                    results = bracketed(timer, arms, rounds=rounds)
                full_layer = layers[str(FULL)][0]
                full_pool = sum(full_layer.layout.region(n).nbytes for n in POOL_REGIONS)
                for key, (layer, _, _) in layers.items():
                    res = results[key]
                    pool = sum(layer.layout.region(n).nbytes for n in POOL_REGIONS)
                    row = {
                        "preset": name,
                        "tokens": t,
                        "mode": mode,
                        "ring": key,
                        "ring_blocks": layer.layout.pool_blocks,
                        "full_pool_blocks": full_layer.layout.pool_blocks,
                        "median_us": res.median_us,
                        "band_us": list(res.band_us),
                        "rounds_us": res.rounds_us,
                        "time_vs_full": res.median_us / results[str(FULL)].median_us,
                        "pool_mib": pool / 2**20,
                        "buffer_mib": layer.layout.total_bytes / 2**20,
                        "pool_vs_full": pool / full_pool,
                        "buffer_vs_full": layer.layout.total_bytes / full_layer.layout.total_bytes,
                    }
                    rows.append(row)
                    print(
                        f"{name:>5} T={t:<6} {mode:>8} ring {key:>7} ({row['ring_blocks']:>6}/"
                        f"{row['full_pool_blocks']} blocks): {res.median_us:10.1f} us x{row['time_vs_full']:.3f}  "
                        f"pool {row['pool_mib']:8.1f} MiB (1/{1 / row['pool_vs_full']:.1f})  "
                        f"buffer {row['buffer_mib']:8.1f} MiB (1/{1 / row['buffer_vs_full']:.2f})",
                        flush=True,
                    )
                if json_path:  # after every cell: a long run cut short keeps what it measured
                    with open(json_path, "w") as f:
                        json.dump(rows, f, indent=2)
                for layer, _, _ in layers.values():
                    layer.close()
                del layers, arms
                cp.get_default_memory_pool().free_all_blocks()
            del inp, args
            cp.get_default_memory_pool().free_all_blocks()
    if png_path:
        from megamoe_rt.cli.png_chart import bar_chart_png

        # One bar per row: time against the same mode's full pool; the line marks +5%.
        with open(png_path, "wb") as f:
            f.write(bar_chart_png([r["time_vs_full"] for r in rows], reference=1.05, bar_px=12))
    return rows
