"""Scheduling arithmetic: published schedule figures, bounds and cycle counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.presets import DEFAULT_EP_RANKS, PRESETS, get_preset
from megamoe_rt.schedule.plan import (
    LAG_GROUP_UNITS,
    TOKEN_ALIGN,
    FusedSchedule,
    align_tokens,
    estimated_units,
    fused_schedule,
    lag_units,
    live_blocks_upper_bound,
    num_cycles,
    num_cycles_across_ranks,
    pool_blocks_upper_bound,
    single_wave_fits,
)

# --------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------


def test_presets_shapes():
    flash, pro, v3 = get_preset("flash"), get_preset("pro"), get_preset("v3")
    assert (flash.hidden, flash.intermediate, flash.num_experts, flash.num_topk) == (4096, 2048, 256, 6)
    assert (pro.hidden, pro.intermediate, pro.num_experts, pro.num_topk) == (7168, 3072, 384, 6)
    assert (v3.hidden, v3.intermediate, v3.num_experts, v3.num_topk) == (7168, 2048, 256, 8)
    assert set(PRESETS) == {"flash", "pro", "v3"}
    assert all(p.name == n for n, p in PRESETS.items())
    assert DEFAULT_EP_RANKS == 8
    assert flash.num_local_experts() == 32 and pro.num_local_experts() == 48


def test_get_preset_unknown_lists_names():
    with pytest.raises(ValueError) as err:
        get_preset("huge")
    msg = str(err.value)
    assert "huge" in msg and "flash" in msg and "pro" in msg and "v3" in msg


# --------------------------------------------------------------------------
# token alignment
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 128), (127, 128), (128, 128), (129, 256), (8192, 8192)])
def test_align_tokens(n, expected):
    assert TOKEN_ALIGN == 128
    assert align_tokens(n) == expected


# --------------------------------------------------------------------------
# published lag figures (EP8, block_m 128)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, bound, units, lag",
    [("flash", 8192, 64, 29), ("flash", 2048, 32, 14), ("pro", 8192, 48, 22)],
)
def test_published_lag_figures(preset, bound, units, lag):
    p = get_preset(preset)
    el = p.num_experts // 8
    assert estimated_units(bound, 8, p.num_topk, p.num_experts, el, 128) == units
    assert lag_units(units) == lag
    sched = fused_schedule(bound, 8, p.num_topk, p.num_experts, 128)
    assert sched.lag_units == lag
    assert sched.group_units == LAG_GROUP_UNITS == 4
    assert sched.ring_blocks == 8 * (lag + 4) + 4
    assert not sched.covers_full_pool


def test_flash_ring_and_full_pool():
    sched = fused_schedule(8192, 8, 6, 256)
    assert sched.ring_blocks == 268
    assert sched.full_pool_blocks == (8 * 8192 * 6 + 32 * 127) // 128 == 3103
    assert live_blocks_upper_bound(sched) == 8 * (29 + 4) == 264


def test_lag_clamp_and_rounding():
    assert lag_units(0) == 8
    assert lag_units(1) == 8
    assert lag_units(18) == 8  # 8.1
    assert lag_units(19) == 9  # 8.55
    assert lag_units(142) == 64  # 63.9 -> 64
    assert lag_units(10_000) == 64
    # 0.45 * 30 = 13.5: halves go up, not to even.
    assert lag_units(30) == 14
    assert lag_units(50) == 23  # 22.5
    assert lag_units(70) == 32  # 31.5
    assert lag_units(130) == 59  # 58.5 (58 is even: banker's would pick it)


@given(st.integers(0, 100_000))
def test_lag_matches_reference_formula(units):
    # Exact rational reference: floor(9u/20 + 1/2) = floor((9u + 10) / 20).
    assert lag_units(units) == min(64, max(8, (9 * units + 10) // 20))


# --------------------------------------------------------------------------
# ring sizing
# --------------------------------------------------------------------------

_shapes = st.tuples(
    st.integers(1, 20_000),  # token bound
    st.sampled_from([1, 2, 4, 8]),  # ranks
    st.integers(1, 48),  # local experts
    st.integers(1, 8),  # topk
    st.sampled_from([64, 128]),
)


@settings(max_examples=300, deadline=None)
@given(_shapes)
def test_ring_never_exceeds_full_pool_and_holds_live_set(shape):
    bound, r, el, k, bm = shape
    e = r * el
    k = min(k, e)
    s = fused_schedule(bound, r, k, e, bm)
    assert s.full_pool_blocks == pool_blocks_upper_bound(bound, r, k, el, bm)
    assert s.ring_blocks <= s.full_pool_blocks
    assert 8 <= s.lag_units <= 64
    if s.covers_full_pool:
        assert s.ring_blocks == s.full_pool_blocks
    else:
        assert s.ring_blocks == 8 * (s.lag_units + s.group_units) + 4
        assert s.ring_blocks >= live_blocks_upper_bound(s)
    # A ring as large as the worst-case pool is exactly the single-wave case.
    assert single_wave_fits(bound, r, k, e, s.ring_blocks, bm) == s.covers_full_pool


def test_small_bound_covers_full_pool():
    s = fused_schedule(1, 8, 6, 256)
    assert s.covers_full_pool
    assert s.ring_blocks == s.full_pool_blocks == (8 * 6 + 32 * 127) // 128
    assert single_wave_fits(1, 8, 6, 256, s.ring_blocks)
    assert not single_wave_fits(8192, 8, 6, 256, 268)


def test_schedule_rejects_ring_below_live_window():
    with pytest.raises(ValueError, match="ring_blocks"):
        FusedSchedule(lag_units=29, group_units=4, ring_blocks=100, full_pool_blocks=3103)
    with pytest.raises(ValueError, match="ring_blocks"):
        FusedSchedule(lag_units=8, group_units=4, ring_blocks=200, full_pool_blocks=100)
    # Clamped to the whole pool, a small ring is fine: it never wraps.
    assert FusedSchedule(8, 4, 50, 50).covers_full_pool


# --------------------------------------------------------------------------
# pool bound against real routings
# --------------------------------------------------------------------------


def _pool_blocks_per_rank(topk_idx: np.ndarray, num_ranks: int, el: int, bm: int):
    """Blocks each destination rank's pool needs for a concrete routing."""
    counts = np.bincount(topk_idx.ravel(), minlength=num_ranks * el)
    per_expert_blocks = -(-counts // bm)
    return per_expert_blocks.reshape(num_ranks, el).sum(axis=1)


@settings(max_examples=120, deadline=None)
@given(
    r=st.sampled_from([1, 2, 4, 8]),
    el=st.integers(1, 12),
    k=st.integers(1, 8),
    t=st.integers(0, 300),
    bm=st.sampled_from([64, 128]),
    skew=st.floats(0.0, 6.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_pool_bound_holds_for_random_routings(r, el, k, t, bm, skew, seed):
    e = r * el
    k = min(k, e)
    rng = np.random.default_rng(seed)
    # Gumbel top-k over skewed log-popularity: distinct experts per token,
    # with a few hot experts when skew is large (the padding-heavy cases).
    log_pop = skew * rng.standard_normal(e)
    scores = log_pop + rng.gumbel(size=(r * t, e))
    topk_idx = np.argsort(-scores, axis=1)[:, :k]
    assert all(len(set(row)) == k for row in topk_idx.tolist())
    bound = pool_blocks_upper_bound(t, r, k, el, bm)
    assert _pool_blocks_per_rank(topk_idx, r, el, bm).max(initial=0) <= bound


def test_pool_bound_is_reached():
    # Every local expert one row past a block boundary is the worst padding.
    r, t, k, el, bm = 2, 128, 2, 4, 64
    bound = pool_blocks_upper_bound(t, r, k, el, bm)
    rows = r * t * min(k, el)  # 512
    assert bound == (512 + 4 * 63) // 64 == 11
    counts = [129, 129, 129, 125]  # sums to 512, three experts need 3 blocks
    assert sum(counts) == rows
    assert sum(math.ceil(c / bm) for c in counts) == bound
    assert pool_blocks_upper_bound(0, 8, 6, 32, 128) == 0


# --------------------------------------------------------------------------
# prefill cycles
# --------------------------------------------------------------------------


@given(st.integers(0, 10**7), st.integers(1, 10**5))
def test_num_cycles_covers_pool_minimally(total, ring):
    c = num_cycles(total, ring)
    assert c >= 1
    assert c * ring >= total
    if total > 0:
        assert (c - 1) * ring < total


def test_num_cycles_examples_and_agreement():
    assert num_cycles(0, 268) == 1
    assert num_cycles(268, 268) == 1
    assert num_cycles(269, 268) == 2
    assert num_cycles(3103, 268) == 12
    assert num_cycles_across_ranks([1, 12, 3]) == 12
    with pytest.raises(ValueError, match="per_rank_cycles"):
        num_cycles_across_ranks([])
    with pytest.raises(ValueError, match="ring_blocks"):
        num_cycles(10, 0)


def test_plan_errors_name_argument():
    with pytest.raises(ValueError, match=r"num_experts=255"):
        fused_schedule(8192, 8, 6, 255)
    with pytest.raises(ValueError, match=r"block_m: expected one of 64, 128, got 96"):
        fused_schedule(8192, 8, 6, 256, 96)
    with pytest.raises(ValueError, match=r"num_tokens_per_rank=-1"):
        pool_blocks_upper_bound(-1, 8, 6, 32, 128)
    with pytest.raises(TypeError, match=r"n: expected an integer, got float 1.5"):
        align_tokens(1.5)
