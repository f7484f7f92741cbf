"""Tile-configuration choice for the grouped FP8 GEMM (kept apart from launch code)."""

from __future__ import annotations

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.gemm import CHECK_LAYOUT_SPEC, GemmConfig, max_stages
from megamoe_rt.schedule.arith import ceil_div

# Tiles built from the one wgmma shape (m64n128k32): rows split across warpgroups
# (128x128), columns split (64x256), or a single warpgroup (64x128).
TILES = ((128, 128), (64, 256), (64, 128))


def _config(bm: int, bn: int, *, a_sf_gran: int, b_sf_n: int, out_sf_gran: int, layout: str,
            epilogue: str) -> GemmConfig:
    # One CTA per tile: CTA pairs sharing the A tile are not built (GemmConfig refuses
    # cluster_n != 1 until their cross-CTA waits carry a deadline).
    return GemmConfig(bm, bn, max_stages(bm, bn, a_sf_gran), a_sf_gran=a_sf_gran, b_sf_n=b_sf_n,
                      out_sf_gran=out_sf_gran, layout=layout, epilogue=epilogue)


def candidate_configs() -> list[GemmConfig]:
    """Every instantiation :func:`choose_config` can return (compiled by `compile --all` and CI)."""
    out: list[GemmConfig] = []
    for layout in ("contiguous", "masked"):
        for bm, bn in TILES:
            for a_gran in (128, 64):
                out.append(_config(bm, bn, a_sf_gran=a_gran, b_sf_n=128, out_sf_gran=128, layout=layout,
                                   epilogue="bf16"))
                if layout == "contiguous":
                    out.append(_config(bm, bn, a_sf_gran=a_gran, b_sf_n=128, out_sf_gran=128, layout=layout,
                                       epilogue="scatter_bf16"))
            for out_gran in (64, 128):
                if out_gran == 128 and (bm, bn) != (64, 256):
                    continue
                out.append(_config(bm, bn, a_sf_gran=128, b_sf_n=64, out_sf_gran=out_gran, layout=layout,
                                   epilogue="swiglu_fp8"))
    return out


def choose_config(*, layout: str, epilogue: str, num_rows: int, n: int, k: int, num_groups: int, sm_count: int,
                  masked_rows: int = 0, a_sf_gran: int = 128, out_sf_gran: int = 128) -> GemmConfig:
    """Pick a tile for a call from its shape and the SM count.

    - 128-wide requant groups in the SwiGLU epilogue need the 64x256 tile.
    - Groups of at most 64 rows (decode) waste half of a 128-row tile: use 64 rows.
    - Otherwise 128x128, unless that leaves most SMs idle, when 64x128 doubles the tiles.
    """
    b_sf_n = 64 if epilogue == "swiglu_fp8" else 128
    kw = dict(a_sf_gran=a_sf_gran, b_sf_n=b_sf_n, out_sf_gran=out_sf_gran if epilogue == "swiglu_fp8" else 128,
              layout=layout, epilogue=epilogue)
    if epilogue == "swiglu_fp8" and out_sf_gran == 128:
        return _config(64, 256, **kw)
    rows_per_group = masked_rows if layout == "masked" else (num_rows // max(num_groups, 1))
    if rows_per_group <= 64:
        return _config(64, 256, **kw) if n % 256 == 0 else _config(64, 128, **kw)
    total_rows = num_groups * masked_rows if layout == "masked" else num_rows
    tiles_128 = ceil_div(total_rows, 128) * (n // 128)
    if tiles_128 < sm_count // 2:
        return _config(64, 128, **kw)
    return _config(128, 128, **kw)


def kernel_specs() -> list[KernelSpec]:
    """Every instantiation the heuristics can choose, and the layout check."""
    return [CHECK_LAYOUT_SPEC] + [c.spec() for c in candidate_configs()]
