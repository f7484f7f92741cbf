"""Tile-configuration choice for the grouped FP8 GEMM (kept apart from launch code)."""

from __future__ import annotations

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.epilogues import EPILOGUES, Epilogue, get_epilogue
from megamoe_rt.kernels.gemm import CHECK_LAYOUT_SPEC, GemmConfig, max_stages
from megamoe_rt.schedule.arith import ceil_div

# Tiles built from the one wgmma shape (m64n128k32): rows split across warpgroups
# (128x128), columns split (64x256), a single warpgroup (64x128), or rows split with each
# warpgroup making two 128-column passes (128x256: half the per-k-block and per-tile fixed
# costs of 128x128 per FLOP).
TILES = ((128, 128), (64, 256), (64, 128), (128, 256))
# Throughput of each tile on full waves, relative to 128x128: flash, pro and v3 at 2048 and 8192
# tokens on the H200, `megamoe-rt bench gemm --tiles` (bench/results/gemm_tiles_h200_2026-12-05.md;
# 128x256 is 1.10-1.13x there and 1.17-1.31x on an H100).
TILE_RATE = {(128, 256): 1.1, (128, 128): 1.0, (64, 256): 0.8, (64, 128): 0.72}
# Tiles also built as CTA pairs along N that share (multicast) the A tile: half the A traffic
# from L2. Offered to `megamoe-rt bench gemm --tiles 128x128c2`, not picked below.
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

    - Groups of at most 64 rows (decode) waste half of a 128-row tile: 64 rows, 256 columns
      where N allows (fewer tiles reading the same weights).
    - Otherwise the tile the epilogue can use whose waves cost least (:func:`tile_cost`).
    """
    epi = get_epilogue(epilogue)
    out_gran = out_sf_gran if epi.requant else 128
    fields = dict(a_sf_gran=a_sf_gran, layout=layout, epilogue=epilogue, cluster_n=1)
    usable = [t for t in TILES if n % t[1] == 0 and _fits(epi, t[0], t[1], out_gran, **fields)]
    if not usable:  # N a multiple of 128 only: the plan refuses it with the reason
        usable = [next(t for t in TILES if _fits(epi, t[0], t[1], out_gran, **fields))]
    rows_per_group = masked_rows if layout == "masked" else ceil_div(num_rows, max(num_groups, 1))
    if rows_per_group <= 64 and any(bm == 64 for bm, _ in usable):
        usable = [t for t in usable if t[0] == 64]
        bm, bn = max(usable, key=lambda t: t[1])
    else:

        def cost(t: tuple[int, int]) -> tuple[float, int]:  # ties: the larger tile
            waves = tile_cost(
                t,
                layout=layout,
                num_rows=num_rows,
                masked_rows=masked_rows,
                n=n,
                num_groups=num_groups,
                sm_count=sm_count,
            )
            return waves, -t[0] * t[1]

        bm, bn = min(usable, key=cost)
    return _config(
        bm, bn, a_sf_gran=a_sf_gran, b_sf_n=epi.b_sf_n, out_sf_gran=out_gran, layout=layout, epilogue=epilogue
    )


def tile_cost(
    tile: tuple[int, int], *, layout: str, num_rows: int, masked_rows: int, n: int, num_groups: int, sm_count: int
) -> float:
    """Time of a call on ``tile`` in units of one 128x128 tile: waves (one tile per SM at a time)
    x the tile's work / its rate (:data:`TILE_RATE`). The tiles are counted as the kernel's
    scheduler walks them (contiguous: the padded rows' m-blocks; masked: every group's)."""
    bm, bn = tile
    m_blocks = ceil_div(num_rows, bm) if layout == "contiguous" else num_groups * ceil_div(masked_rows, bm)
    waves = ceil_div(m_blocks * (n // bn), sm_count)
    return waves * (bm * bn) / (128 * 128) / TILE_RATE[tile]


def kernel_specs() -> list[KernelSpec]:
    """Every instantiation the heuristics can choose, and the layout check."""
    return [CHECK_LAYOUT_SPEC] + [c.spec() for c in candidate_configs() + paired_tile_configs()]
