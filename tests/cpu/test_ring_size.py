"""Ring sizes from ``chunk_ratio`` (megamoe_rt/schedule/ring_size.py) and the layer's checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megamoe_rt.modes.base import LayerSpec, buffer_layout
from megamoe_rt.modes.fused import FusedMode
from megamoe_rt.modes.registry import select_mode
from megamoe_rt.modes.split import SplitMode
from megamoe_rt.modes.unfused import UnfusedMode
from megamoe_rt.schedule.ring_size import (
    AUTO_MEMORY_SHARE,
    PoolCost,
    check_chunk_ratio,
    ring_blocks_for_memory,
    ring_blocks_for_ratio,
)


@given(full=st.integers(1, 100_000), ratio=st.floats(1e-6, 1.0), minimum=st.integers(1, 200))
def test_a_ratio_gives_its_share_of_the_pool_within_the_mode_minimum_and_the_pool(full, ratio, minimum):
    ring = ring_blocks_for_ratio(full, ratio, minimum)
    assert 1 <= ring <= full
    assert ring == min(full, max(minimum, math.ceil(ratio * full)))


@given(
    per_block=st.integers(1, 1 << 20),
    fixed=st.integers(0, 1 << 32),
    full=st.integers(1, 50_000),
    free=st.integers(0, 1 << 40),
    minimum=st.integers(1, 64),
)
def test_auto_takes_the_whole_pool_when_it_fits_else_the_largest_ring_that_does(per_block, fixed, full, free, minimum):
    cost = PoolCost(per_block, fixed, full)
    ring = ring_blocks_for_memory(cost, free, minimum)
    budget = int(AUTO_MEMORY_SHARE * free)
    assert 1 <= ring <= full
    if cost.total(full) <= budget:
        assert ring == full
    elif ring > minimum:  # above its floor a ring fits the budget, and one more block would not
        assert cost.total(ring) <= budget < cost.total(ring + 1)
    else:
        assert ring == min(full, minimum) or cost.total(ring) <= budget


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), float("inf")])
def test_ratios_outside_zero_to_one_are_refused(bad):
    with pytest.raises(ValueError, match="chunk_ratio: expected a number in \\(0, 1\\] or 'auto'"):
        check_chunk_ratio(bad)


@pytest.mark.parametrize("bad", ["half", True, None, [0.5]])
def test_ratios_of_the_wrong_kind_are_a_type_error(bad):
    with pytest.raises(TypeError, match="chunk_ratio"):
        check_chunk_ratio(bad)


def _spec(**kw):
    base = dict(hidden=512, intermediate=256, num_experts=16, num_topk=6, num_max_tokens_per_rank=8192)
    base.update(kw)
    return LayerSpec(**base)


def test_each_ring_mode_states_its_smallest_ring_and_a_layout_takes_it():
    spec = _spec()
    fused_min, split_min = FusedMode.minimum_ring_blocks(spec), SplitMode.minimum_ring_blocks(spec)
    assert split_min == 32  # the blocks of one group of units at lag 0
    assert fused_min > split_min  # the fused ring also holds the lag window
    unfused_min = UnfusedMode.minimum_ring_blocks(spec)
    assert unfused_min == -(-buffer_layout(spec, UnfusedMode.layout_needs(spec)).pool_blocks // 64)
    for cls, ring in ((FusedMode, fused_min), (SplitMode, split_min), (UnfusedMode, unfused_min)):
        lay = buffer_layout(spec, cls.layout_needs(spec, ring))
        cls(spec, lay)  # the mode accepts the smallest ring it states
        assert lay.pool_blocks == ring
    with pytest.raises(ValueError, match="live window"):
        FusedMode(spec, buffer_layout(spec, FusedMode.layout_needs(spec, fused_min - 1)))


@given(
    capacity=st.integers(1, 20_000),
    ranks=st.sampled_from([1, 2, 4, 8]),
    experts_per_rank=st.integers(1, 64),
    topk=st.integers(1, 32),
    ratio=st.sampled_from([1e-9, 0.01, 0.3, 1.0]),
)
def test_any_chunk_ratio_gives_a_ring_the_mode_accepts(capacity, ranks, experts_per_rank, topk, ratio):
    """The smallest ring a mode states is the one its own check accepts, also for capacities
    the buffer rounds up (a capacity of 1 is a buffer of 128 tokens)."""
    from megamoe_rt.modes.sizing import ring_for_chunk_ratio

    experts = ranks * experts_per_rank
    spec = _spec(num_experts=experts, num_topk=min(topk, experts), num_max_tokens_per_rank=capacity, num_ranks=ranks)
    for cls in (FusedMode, SplitMode, UnfusedMode):
        ring = ring_for_chunk_ratio(cls, spec, ratio, lambda: 0)
        lay = buffer_layout(spec, cls.layout_needs(spec, ring))
        assert lay.pool_blocks == ring
        cls(spec, lay)


def test_chunk_ratio_is_checked_with_the_mode_before_looking_for_a_gpu():
    from megamoe_rt.layer import MegaMoE

    assert select_mode("unfused", _spec(), chunk_ratio=0.5) is UnfusedMode
    with pytest.raises(ValueError, match="pass one of them"):
        select_mode("split", _spec(), ring_blocks=40, chunk_ratio=0.5)
    with pytest.raises(ValueError, match="chunk_ratio"):
        MegaMoE(512, 256, 16, 6, 1024, mode="split", chunk_ratio=2.0)
    with pytest.raises(ValueError, match="chunk_ratio"):
        MegaMoE(512, 256, 16, 6, 1024, mode="unfused", chunk_ratio=0.0)
    with pytest.raises(TypeError, match="chunk_ratio"):
        MegaMoE(512, 256, 16, 6, 1024, mode="split", chunk_ratio="most")
