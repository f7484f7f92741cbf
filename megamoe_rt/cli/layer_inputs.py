"""Random inputs of one rank's layer call for the layer benchmarks (GPU-generated)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset


def preset_slices(presets: list[str], tokens: list[int], world: int) -> Iterator[tuple[str, Any, int, int, int]]:
    """``(preset name, preset, local experts, experts across world ranks, tokens)`` for every
    benchmark cell: each rank holds the preset's EP8 per-rank slice of experts, so per-GPU
    numbers compare with the one-GPU benchmarks at the same slice."""
    for name in presets:
        p = get_preset(name)
        local = p.num_experts // DEFAULT_EP_RANKS
        for t in tokens:
            yield name, p, local, local * world, t


def rank_inputs(
    cp, rank: int, tokens: int, hidden: int, intermediate: int, experts: int, local: int, topk: int, seed: int
):
    from megamoe_rt.kernels.quantize import quantize_fp8, quantize_weight_fp8

    rs = cp.random.RandomState(seed * 1000 + rank)
    x, x_sf = quantize_fp8(rs.standard_normal((tokens, hidden), dtype=cp.float32))
    logits = rs.standard_normal((tokens, experts), dtype=cp.float32)
    topk_idx = cp.argsort(-logits, axis=1)[:, :topk].astype(cp.int32)
    topk_weights = cp.full((tokens, topk), 1.0 / topk, dtype=cp.float32)
    # Only this rank's experts: nobody else multiplies by them.
    w1, w1_sf = quantize_weight_fp8(rs.standard_normal((local, 2 * intermediate, hidden), dtype=cp.float32) / 64)
    w2, w2_sf = quantize_weight_fp8(rs.standard_normal((local, hidden, intermediate), dtype=cp.float32) / 64)
    return (x, x_sf, topk_idx, topk_weights), (w1, w1_sf, w2, w2_sf)
