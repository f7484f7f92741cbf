"""Tile-configuration choice for the grouped FP8 GEMM (kept apart from launch code)."""

from __future__ import annotations

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.epilogues import EPILOGUES, Epilogue, get_epilogue
from megamoe_rt.kernels.gemm import CHECK_LAYOUT_SPEC, GemmConfig, max_stages
from megamoe_rt.schedule.arith import ceil_div

# Tiles built from the one wgmma shape (m64n128k32): rows split across warpgroups
# (128x128), columns split (64x256), a single warpgroup (64x128), or rows split with each
# warpgroup making two 128-column passes (128x256: less shared-memory traffic per FLOP;
# built and offered to `megamoe-rt bench gemm --tiles`, not picked below until measured).
TILES = ((128, 128), (64, 256), (64, 128), (128, 256))
# Tiles also built as CTA pairs along N that share (multicast) the A tile: half the A traffic
# from L2. Offered to `megamoe-rt bench gemm --tiles 128x128c2`, not picked below until measured.
PAIRED_TILES = ((128, 128),)


def _config(
    bm: int,
    bn: int,
    *,
    a_sf_gran: int,
    b_sf_n: int,
    out_sf_gran: int,
    layout: str,
    epilogue: str,
    cluster_n: int = 1,
) -> GemmConfig:
    return GemmConfig(
        bm,
        bn,
        max_stages(bm, bn),
        a_sf_gran=a_sf_gran,
        b_sf_n=b_sf_n,
        out_sf_gran=out_sf_gran,
        cluster_n=cluster_n,
        layout=layout,
        epilogue=epilogue,
    )


def tile_config(
    bm: int,
    bn: int,
    *,
    layout: str,
    epilogue: str,
    a_sf_gran: int = 128,
    out_sf_gran: int = 128,
    cluster_n: int = 1,
) -> GemmConfig:
    """The configuration of tile ``bm x bn`` for an epilogue (a forced tile: tuning, benchmarks);
    ``cluster_n=2``: as CTA pairs sharing the A tile (:data:`PAIRED_TILES`)."""
    built = TILES if cluster_n == 1 else PAIRED_TILES if cluster_n == 2 else ()
    if (bm, bn) not in built:
        names = [f"{m}x{n}" for m, n in TILES] + [f"{m}x{n}c2" for m, n in PAIRED_TILES]
        raise ValueError(f"tile {bm}x{bn} with cluster_n={cluster_n}: expected one of {', '.join(names)}")
    epi = get_epilogue(epilogue)
    return _config(
        bm,
        bn,
        a_sf_gran=a_sf_gran,
        b_sf_n=epi.b_sf_n,
        out_sf_gran=out_sf_gran if epi.requant else 128,
        layout=layout,
        epilogue=epilogue,
        cluster_n=cluster_n,
    )


def paired_tile_configs() -> list[GemmConfig]:
    """The CTA-pair instantiations `bench gemm --tiles` can force: the plain bf16 epilogue in both
    layouts (what the benchmark runs). Compiled and tested like the heuristic's candidates."""
    return [
        tile_config(bm, bn, layout=layout, epilogue="bf16", cluster_n=2)
        for bm, bn in PAIRED_TILES
        for layout in ("contiguous", "masked")
    ]


def _fits(epi: Epilogue, bm: int, bn: int, out_sf_gran: int, **fields: object) -> bool:
    return epi.problem(block_m=bm, block_n=bn, b_sf_n=epi.b_sf_n, out_sf_gran=out_sf_gran, **fields) is None


def candidate_configs() -> list[GemmConfig]:
    """Every instantiation :func:`choose_config` can return (compiled by `compile --all` and CI):
    each registered epilogue on every tile, in the layouts and granularities it is built for."""
    out: list[GemmConfig] = []
    for layout in ("contiguous", "masked"):
        for bm, bn in TILES:
            for epi in EPILOGUES.values():
                if layout not in epi.layouts:
                    continue
                for a_gran in epi.a_sf_grans:
                    for out_gran in epi.out_sf_grans:
                        if _fits(
                            epi, bm, bn, out_gran, cluster_n=1, a_sf_gran=a_gran, layout=layout, epilogue=epi.name
                        ):
                            out.append(
                                _config(
                                    bm,
                                    bn,
                                    a_sf_gran=a_gran,
                                    b_sf_n=epi.b_sf_n,
                                    out_sf_gran=out_gran,
                                    layout=layout,
                                    epilogue=epi.name,
                                )
                            )
    return out


def choose_config(
    *,
    layout: str,
    epilogue: str,
    num_rows: int,
    n: int,
    k: int,
    num_groups: int,
    sm_count: int,
    masked_rows: int = 0,
    a_sf_gran: int = 128,
    out_sf_gran: int = 128,
) -> GemmConfig:
    """Pick a tile for a call from its shape and the SM count.

    - Groups of at most 64 rows (decode) waste half of a 128-row tile: use 64 rows.
    - Otherwise 128x128, unless that leaves most SMs idle, when 64x128 doubles the tiles.
    - A tile the epilogue cannot use gives way to the first in :data:`TILES` it can (128-wide
      requant groups in the SwiGLU epilogue need the 64x256 tile).
    """
    epi = get_epilogue(epilogue)
    out_gran = out_sf_gran if epi.requant else 128
    bm, bn = _preferred_tile(
        layout=layout, num_rows=num_rows, n=n, num_groups=num_groups, sm_count=sm_count, masked_rows=masked_rows
    )
    fields = dict(a_sf_gran=a_sf_gran, layout=layout, epilogue=epilogue, cluster_n=1)
    if not _fits(epi, bm, bn, out_gran, **fields):
        bm, bn = next(t for t in TILES if _fits(epi, t[0], t[1], out_gran, **fields))
    return _config(
        bm, bn, a_sf_gran=a_sf_gran, b_sf_n=epi.b_sf_n, out_sf_gran=out_gran, layout=layout, epilogue=epilogue
    )


def _preferred_tile(
    *, layout: str, num_rows: int, n: int, num_groups: int, sm_count: int, masked_rows: int
) -> tuple[int, int]:
    rows_per_group = masked_rows if layout == "masked" else (num_rows // max(num_groups, 1))
    if rows_per_group <= 64:
        return (64, 256) if n % 256 == 0 else (64, 128)
    total_rows = num_groups * masked_rows if layout == "masked" else num_rows
    tiles_128 = ceil_div(total_rows, 128) * (n // 128)
    if tiles_128 < sm_count // 2:
        return 64, 128
    return 128, 128


def kernel_specs() -> list[KernelSpec]:
    """Every instantiation the heuristics can choose, and the layout check."""
    return [CHECK_LAYOUT_SPEC] + [c.spec() for c in candidate_configs() + paired_tile_configs()]
