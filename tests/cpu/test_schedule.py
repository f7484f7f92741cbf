"""Property tests of the fused lag task order and its ring pool (CPU)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.plan import LAG_GROUP_UNITS, UNIT_BLOCKS, fused_schedule, lag_units
from megamoe_rt.schedule.task_order import (
    RingViolation,
    Task,
    check_order,
    expert_units,
    lag_task_order,
    ring_blocks_for,
    single_wave_order,
    task_tiles,
)

blocks_lists = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=48)


def test_units_split_experts_in_runs_of_at_most_eight_blocks():
    units = expert_units([0, 3, 17, 8])
    assert [(u.expert, u.num_blocks) for u in units] == [(1, 3), (2, 8), (2, 8), (2, 1), (3, 8)]
    assert [u.first_block for u in units] == [0, 3, 11, 19, 20]


def test_l2_trails_l1_by_the_lag_in_groups():
    order = [(t.kind, t.unit.index) for t in lag_task_order([8] * 20, lag=8, group=4)]  # 20 units of 8 blocks
    # The first L2 group (units 0-3) is released right after L1 of unit 11 = 0 + lag + group - 1.
    first_l2 = order.index(("l2", 0))
    assert order[first_l2 - 1] == ("l1", 11)
    assert order[first_l2 : first_l2 + 4] == [("l2", 0), ("l2", 1), ("l2", 2), ("l2", 3)]
    for u in range(20):
        assert order.index(("l1", u)) < order.index(("l2", u))


@settings(max_examples=300, deadline=None)
@given(blocks=blocks_lists, lag=st.integers(8, 64), group=st.integers(1, 8))
def test_ring_of_eight_times_lag_plus_group_plus_margin_is_sufficient(blocks, lag, group):
    order = lag_task_order(blocks, lag, group)
    ring = UNIT_BLOCKS * (lag + group) + 4
    max_live = check_order(order, ring)
    # The live window never exceeds (lag + group) units of at most 8 blocks.
    assert max_live <= UNIT_BLOCKS * (lag + group)
    assert sum(t.kind == "l1" for t in order) == sum(t.kind == "l2" for t in order) == len(expert_units(blocks))


@settings(max_examples=200, deadline=None)
@given(blocks=blocks_lists, lag=st.integers(8, 64))
def test_default_group_ring_is_what_the_host_allocates(blocks, lag):
    check_order(lag_task_order(blocks, lag, LAG_GROUP_UNITS), ring_blocks_for(lag))


def test_a_ring_below_the_live_window_is_caught():
    order = lag_task_order([8] * 40, lag=8, group=4)
    check_order(order, ring_blocks_for(8))
    with pytest.raises(RingViolation, match="overwrites ring slot"):
        check_order(order, UNIT_BLOCKS * 8)  # lag units only: the group is missing


@settings(max_examples=100, deadline=None)
@given(blocks=blocks_lists)
def test_single_wave_needs_the_whole_pool(blocks):
    order = single_wave_order(blocks)
    total = sum(blocks)
    if total == 0:
        assert order == []
        return
    assert check_order(order, total) == total
    if total > 1:
        with pytest.raises(RingViolation):
            check_order(order, total - 1)


def test_order_violations_are_reported():
    units = expert_units([2, 2])
    with pytest.raises(RingViolation, match="before its L1"):
        check_order([Task("l2", units[0]), Task("l1", units[0])], 16)
    with pytest.raises(RingViolation, match="without an L2"):
        check_order([Task("l1", units[0]), Task("l1", units[1]), Task("l2", units[0])], 16)


@pytest.mark.parametrize("preset,tokens,expect_lag", [("flash", 8192, 29), ("flash", 2048, 14), ("pro", 8192, 22)])
def test_host_schedule_is_safe_for_uniform_routing_at_the_bound(preset, tokens, expect_lag):
    from megamoe_rt.presets import get_preset

    p = get_preset(preset)
    sched = fused_schedule(tokens, 8, p.num_topk, p.num_experts)
    assert (
        sched.lag_units
        == expect_lag
        == lag_units((p.num_experts // 8) * -(-(-(-8 * tokens * p.num_topk // p.num_experts) // 128) // 8))
    )
    per_expert = -(-8 * tokens * p.num_topk // p.num_experts) // 128 + 1
    check_order(lag_task_order([per_expert] * (p.num_experts // 8), sched.lag_units), sched.ring_blocks)


@settings(max_examples=200, deadline=None)
@given(ranks=st.lists(blocks_lists, min_size=1, max_size=8), ring=st.integers(1, 64))
def test_prefill_cycles_cover_every_block_once_and_agree_across_ranks(ranks, ring):
    from megamoe_rt.schedule.plan import num_cycles, num_cycles_across_ranks
    from megamoe_rt.schedule.task_order import pull_cycles

    per_rank = [num_cycles(sum(b), ring) for b in ranks]
    agreed = num_cycles_across_ranks(per_rank)
    for blocks in ranks:
        cycles = pull_cycles(blocks, ring, agreed)
        assert len(cycles) == agreed == max(per_rank)
        pulled = [pair for c in cycles for pair in c]
        assert pulled == [(e, b) for e, n in enumerate(blocks) for b in range(n)]  # each once, in pool order
        assert all(len(c) <= ring for c in cycles)
        # Only the last cycles may be short; a rank with fewer blocks just runs empty ones.
        sizes = [len(c) for c in cycles]
        assert sizes == sorted(sizes, reverse=True)


def test_a_rank_cannot_run_fewer_cycles_than_it_needs():
    from megamoe_rt.schedule.task_order import pull_cycles

    with pytest.raises(ValueError, match="needs 3"):
        pull_cycles([10, 10], 8, num_cycles=2)


# --- the order expanded to tiles (the device order: tests/gpu/test_task_order_gpu.py) -----------------


def _tiles(order, n1, n2):
    return [t for task in order for t in task_tiles(task, n1, n2)]


def test_a_task_expands_n_block_major_over_its_unit():
    unit = expert_units([0, 3])[0]
    assert [(t.kind, t.block, t.expert, t.n_block) for t in task_tiles(Task("l1", unit), 2, 5)] == [
        ("l1", 0, 1, 0),
        ("l1", 1, 1, 0),
        ("l1", 2, 1, 0),
        ("l1", 0, 1, 1),
        ("l1", 1, 1, 1),
        ("l1", 2, 1, 1),
    ]
    assert [(t.block, t.n_block) for t in task_tiles(Task("l2", unit), 2, 1)] == [(0, 0), (1, 0), (2, 0)]


@settings(max_examples=300, deadline=None)
@given(blocks=blocks_lists, lag=st.integers(0, 70), group=st.integers(1, 8), n1=st.integers(1, 5), n2=st.integers(1, 5))
def test_every_tile_comes_once_and_l2_tiles_after_their_blocks_l1_tiles(blocks, lag, group, n1, n2):
    tiles = _tiles(lag_task_order(blocks, lag, group), n1, n2)
    assert len({(t.kind, t.block, t.n_block) for t in tiles}) == len(tiles) == sum(blocks) * (n1 + n2)
    last_l1 = {t.block: i for i, t in enumerate(tiles) if t.kind == "l1"}
    first_l2 = {}
    for i, t in enumerate(tiles):
        if t.kind == "l2":
            first_l2.setdefault(t.block, i)
    assert all(last_l1[b] < first_l2[b] for b in first_l2)


@settings(max_examples=200, deadline=None)
@given(blocks=blocks_lists, lag=st.integers(8, 64), group=st.integers(1, 8))
def test_no_l1_tile_overwrites_a_ring_slot_still_being_read(blocks, lag, group):
    ring = ring_blocks_for(lag, group)
    seen_l2 = {}
    for i, t in enumerate(_tiles(lag_task_order(blocks, lag, group), 2, 3)):
        if t.kind == "l2":
            seen_l2[t.block] = seen_l2.get(t.block, 0) + 1
        elif t.block >= ring:
            # The kernel waits here for all L2 tiles of block - ring: they must all be earlier.
            assert seen_l2.get(t.block - ring, 0) == 3, (i, t)


@settings(max_examples=100, deadline=None)
@given(blocks=blocks_lists, extra=st.integers(0, 100), group=st.integers(1, 8))
def test_a_lag_past_the_unit_count_is_the_single_wave_order(blocks, extra, group):
    # The host asks for the single-wave order with a lag of its worst-case block count.
    lag = max(len(expert_units(blocks)), 1) + extra
    assert lag_task_order(blocks, lag, group) == single_wave_order(blocks)
