"""Grouped GEMM configuration: heuristics and the shared-memory budget (CPU). The host and
device structs are declared once; tests/cpu/test_interface.py checks them."""

from __future__ import annotations

import pytest

from megamoe_rt.jit.paths import cuda_src_dir
from megamoe_rt.kernels.epilogues import EPILOGUES, get_epilogue
from megamoe_rt.kernels.gemm import SMEM_LIMIT, GemmConfig
from megamoe_rt.kernels.gemm_heuristics import (
    TILE_RATE,
    TILES,
    candidate_configs,
    choose_config,
    kernel_specs,
    tile_config,
    tile_cost,
)
from megamoe_rt.presets import PRESETS

CANDIDATES = {c.name: c for c in candidate_configs()}


def _shapes():
    """L1 and L2 grouped shapes of every preset's EP8 slice at several token counts."""
    for preset in PRESETS.values():
        e_local = preset.num_experts // 8
        for tokens in (64, 512, 2048, 8192):
            rows_per_expert = -(-tokens * 8 * preset.num_topk // preset.num_experts)
            rows = e_local * -(-rows_per_expert // 128) * 128
            yield preset.name, tokens, "l1", rows, 2 * preset.intermediate, preset.hidden, e_local, rows_per_expert
            yield preset.name, tokens, "l2", rows, preset.hidden, preset.intermediate, e_local, rows_per_expert


@pytest.mark.parametrize("shape", list(_shapes()), ids=lambda s: f"{s[0]}-{s[1]}-{s[2]}")
@pytest.mark.parametrize("sm_count", [132, 114, 64])
def test_heuristic_returns_a_compiled_valid_config(shape, sm_count):
    _, _, stage, rows, n, k, groups, per_expert = shape
    for layout, masked_rows in (("contiguous", 0), ("masked", max(64, -(-per_expert // 64) * 64))):
        if stage == "l1":
            for gran in (64, 128):
                cfg = choose_config(
                    layout=layout,
                    epilogue="swiglu_fp8",
                    num_rows=rows,
                    n=n,
                    k=k,
                    num_groups=groups,
                    sm_count=sm_count,
                    masked_rows=masked_rows,
                    out_sf_gran=gran,
                )
                _check(cfg, n)
        for epi in ("bf16", "scatter_bf16") if layout == "contiguous" else ("bf16",):
            for a_gran in (64, 128):
                cfg = choose_config(
                    layout=layout,
                    epilogue=epi,
                    num_rows=rows,
                    n=n,
                    k=k,
                    num_groups=groups,
                    sm_count=sm_count,
                    masked_rows=masked_rows,
                    a_sf_gran=a_gran,
                )
                _check(cfg, n)


def _check(cfg: GemmConfig, n: int):
    assert cfg.name in CANDIDATES, f"{cfg.name} is not among the compiled variants"
    assert n % cfg.block_n == 0
    assert cfg.dynamic_smem_bytes <= SMEM_LIMIT
    assert cfg.stages >= 3


def test_stage_count_uses_the_shared_memory():
    for cfg in candidate_configs():
        per = GemmConfig.stage_bytes(cfg.block_m, cfg.block_n, cfg.a_sf_gran)
        if cfg.stages < 8:  # one more stage would not fit
            assert cfg.dynamic_smem_bytes + per > SMEM_LIMIT


def test_tiles_split_rows_first_and_make_passes_over_wide_columns():
    """Mirrors Config::kWgM / kWgN / kNPasses (gemm/config.cuh): at most two math warpgroups;
    128 x 256 splits rows and each warpgroup covers its 256 columns in two 128-column passes."""
    split = {(c.block_m, c.block_n): (c.num_math_warpgroups, c.n_passes, c.num_threads) for c in CANDIDATES.values()}
    assert split == {
        (128, 128): (2, 1, 384),
        (64, 256): (2, 1, 384),
        (64, 128): (1, 1, 256),
        (128, 256): (2, 2, 384),
    }


def test_invalid_configs_are_rejected():
    with pytest.raises(ValueError, match="BLOCK_M"):
        GemmConfig(96, 128, 4)
    with pytest.raises(ValueError, match="64x256"):
        GemmConfig(128, 128, 4, b_sf_n=64, out_sf_gran=128, epilogue="swiglu_fp8")
    with pytest.raises(ValueError, match="shared memory"):
        GemmConfig(128, 128, 8)


def test_cta_pairs_are_built_for_the_128x128_tile_only():
    from megamoe_rt.kernels.gemm_heuristics import paired_tile_configs, tile_config

    paired = GemmConfig(128, 128, 6, cluster_n=2)
    assert paired.name == "fp8_gemm[contiguous,bf16,128x128,c2,s6,asf128,bsf128,osf128]"
    for bad in (
        dict(block_m=64, block_n=128, cluster_n=2),
        dict(block_m=128, block_n=128, cluster_n=3),
        dict(block_m=128, block_n=128, cluster_n=2, epilogue="scatter_bf16"),
    ):
        with pytest.raises(ValueError, match="CTA pairs are built for the 128x128 tile with the bf16 epilogue only"):
            GemmConfig(stages=4, **bad)
    with pytest.raises(ValueError, match="128x128c2"):
        tile_config(128, 256, layout="contiguous", epilogue="bf16", cluster_n=2)
    # What `bench gemm --tiles 128x128c2` can force is compiled with every other kernel.
    names = {s.name for s in kernel_specs()}
    assert {c.name for c in paired_tile_configs()} <= names
    assert {c.cluster_n for c in paired_tile_configs()} == {2}


@pytest.mark.parametrize("limit", [-1.0, 0.0, float("nan"), float("inf")])
def test_swiglu_limit_is_validated_before_anything_else(limit):
    from megamoe_rt.kernels.grouped_gemm import grouped_gemm_swiglu_fp8

    with pytest.raises(ValueError, match="swiglu_limit"):
        grouped_gemm_swiglu_fp8(None, None, None, None, None, group_offsets=object(), swiglu_limit=limit)


def test_group_counts_only_with_the_contiguous_layout():
    from megamoe_rt.kernels.grouped_gemm import grouped_gemm_swiglu_fp8

    with pytest.raises(ValueError, match="group_counts applies to the contiguous layout only"):
        grouped_gemm_swiglu_fp8(None, None, None, None, None, masked_counts=object(), group_counts=object())


def test_every_registered_epilogue_has_built_variants_naming_its_policy():
    built = candidate_configs()
    for epi in EPILOGUES.values():
        assert (cuda_src_dir() / epi.header).is_file()
        specs = [c.spec() for c in built if c.epilogue == epi.name]
        assert specs, epi.name
        for s in specs:
            assert s.entry.endswith(f", {epi.cxx_type}>") and s.includes == (epi.header,)


def test_epilogue_rules_reject_configs_and_steer_the_heuristic():
    with pytest.raises(ValueError, match="64-column B scales"):
        GemmConfig(64, 256, 4, b_sf_n=128, out_sf_gran=64, epilogue="swiglu_fp8")
    with pytest.raises(ValueError, match="epilogue 'nope' unknown"):
        get_epilogue("nope")
    with pytest.raises(ValueError, match="256-column tile"):
        GemmConfig(128, 128, 4, b_sf_n=64, out_sf_gran=128, epilogue="swiglu_fp8")
    GemmConfig(128, 256, 4, b_sf_n=64, out_sf_gran=128, epilogue="swiglu_fp8")  # both passes hold the group
    # Few rows: a 128-wide requant group still gets a 256-column tile (64 rows at decode).
    cfg = choose_config(
        layout="contiguous", epilogue="swiglu_fp8", num_rows=256, n=4096, k=2048, num_groups=4, sm_count=132
    )
    assert (cfg.block_m, cfg.block_n, cfg.b_sf_n, cfg.out_sf_gran) == (64, 256, 64, 128)
    cfg = choose_config(
        layout="contiguous", epilogue="bf16", num_rows=8192, n=4096, k=2048, num_groups=4, sm_count=132, out_sf_gran=64
    )
    assert (cfg.block_m, cfg.block_n, cfg.b_sf_n, cfg.out_sf_gran) == (128, 256, 128, 128)


@pytest.mark.parametrize("epilogue", ["bf16", "swiglu_fp8"])
def test_heuristic_takes_the_cheapest_waves(epilogue):
    def pick(rows_per_group, n, groups=32, sms=132):
        cfg = choose_config(
            layout="contiguous",
            epilogue=epilogue,
            num_rows=rows_per_group * groups,
            n=n,
            k=4096,
            num_groups=groups,
            sm_count=sms,
        )
        return cfg.block_m, cfg.block_n

    # Many tiles: the wide tile's rate wins over its coarser last wave.
    assert pick(1536, 4096) == (128, 256)
    # Decode: 64-row tiles, 256 columns where N allows.
    assert pick(40, 4096) == (64, 256)
    # N a multiple of 128 only: no 256-column tile (the SwiGLU epilogue's 128-wide groups then
    # have no tile at all and the plan refuses the call).
    if epilogue == "bf16":
        assert pick(1536, 4224)[1] == 128
    # Too few tiles to fill the SMs: smaller tiles spread the work.
    assert pick(256, 512, groups=2)[0] * pick(256, 512, groups=2)[1] <= 64 * 256
    # The choice never costs more than any tile the epilogue can use.
    for rows in (96, 192, 384, 1536):
        bm, bn = pick(rows, 4096)
        shape = dict(layout="contiguous", num_rows=rows * 32, masked_rows=0, n=4096, num_groups=32, sm_count=132)
        chosen = tile_cost((bm, bn), **shape)
        epi = get_epilogue(epilogue)
        for t in TILES:
            if epi.problem(block_m=t[0], block_n=t[1], b_sf_n=epi.b_sf_n, out_sf_gran=128) is None:
                assert chosen <= tile_cost(t, **shape)


def test_the_cost_model_counts_tiles_as_the_scheduler_does():
    from megamoe_rt.kernels.gemm import num_tiles
    from megamoe_rt.kernels.interface.structs import GemmParams

    for layout, num_rows, masked_rows, groups in (("contiguous", 3 * 128 + 640, 0, 5), ("masked", 0, 192, 5)):
        for bm, bn in TILES:
            cfg = tile_config(bm, bn, layout=layout, epilogue="bf16")
            params = GemmParams(num_rows=num_rows, masked_rows=masked_rows, n=1024, num_groups=groups)
            shape = dict(layout=layout, num_rows=num_rows, masked_rows=masked_rows, n=1024, num_groups=groups)
            cost = tile_cost((bm, bn), sm_count=1, **shape)
            assert cost * TILE_RATE[(bm, bn)] == pytest.approx(num_tiles(cfg, params) * bm * bn / (128 * 128))
