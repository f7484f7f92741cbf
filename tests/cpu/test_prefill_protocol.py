"""The cycle-chunked dispatch model (megamoe_rt/schedule/prefill_protocol.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.prefill_protocol import (
    RELOAD_ON_CHANGE_IN_ITERATION,
    RELOAD_WHEN_STALE,
    PrefillModel,
    StaleCounts,
    agreed_cycles,
)


def _expected_sources(counts):
    return [s for per_source in counts for s, n in enumerate(per_source) for _ in range(n)]


routings = st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    counts=routings,
    block_rows=st.integers(1, 4),
    ring=st.integers(1, 5),
    workers=st.integers(1, 5),
    order=st.lists(st.integers(0, 9), max_size=12),
)
def test_reloading_stale_counts_pulls_every_row_from_its_source_in_every_round(
    counts, block_rows, ring, workers, order
):
    ranks = max(len(c) for c in counts)
    counts = [c + [0] * (ranks - len(c)) for c in counts]
    model = PrefillModel(counts, block_rows, ring, workers, policy=RELOAD_WHEN_STALE)
    assert model.cycles == max(1, -(-model.total_blocks // ring))
    assert model.run(order) == _expected_sources(counts)
    assert model.released == model.total_blocks  # every block went through the GEMM side


def test_reloading_only_on_a_change_in_the_same_iteration_goes_stale_across_a_round():
    # Two experts of one block each, a ring of one block, one worker: the worker's scan for its
    # next row crosses into expert 1 at the end of round 0, then stops at the round's bound;
    # round 1 starts on expert 1 with expert 0's counts.
    counts = [[1, 0], [0, 1]]
    with pytest.raises(StaleCounts, match="expert 1 looked up with expert 0's counts"):
        PrefillModel(counts, 1, 1, 1, policy=RELOAD_ON_CHANGE_IN_ITERATION).run()
    assert PrefillModel(counts, 1, 1, 1, policy=RELOAD_WHEN_STALE).run() == [0, 1]


@settings(max_examples=200, deadline=None)
@given(totals=st.lists(st.integers(0, 40), min_size=1, max_size=8), ring=st.integers(1, 16))
def test_every_rank_runs_the_agreed_cycle_count_and_empty_rounds_are_harmless(totals, ring):
    cycles = agreed_cycles(totals, ring)
    assert cycles == max(max(1, -(-t // ring)) for t in totals)
    for t in totals:  # one expert from one source, t blocks of one row each
        model = PrefillModel([[t]], 1, ring, 3, cycles=cycles)
        assert model.cycles == cycles
        assert model.run() == [0] * t


def test_fewer_cycles_than_a_rank_needs_are_refused():
    with pytest.raises(ValueError, match="cycles=1: this rank needs 3"):
        PrefillModel([[5]], 2, 1, 2, cycles=1)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    ranks=st.integers(1, 4),
    local_experts=st.integers(1, 6),
    topk=st.integers(1, 4),
    bound=st.integers(1, 300),
    block_m=st.sampled_from([64, 128]),
    share=st.floats(0.01, 1.0),
)
def test_the_cycles_a_host_enqueues_for_a_bound_cover_every_routing_within_it(
    data, ranks, local_experts, topk, bound, block_m, share
):
    """The unfused ring: every rank enqueues cycles_to_launch(bound) cycles, from the shape
    alone; whatever the routing of at most `bound` tokens per rank, this rank's pool, walked
    in windows of the ring, fits in them."""
    from megamoe_rt.schedule.plan import cycles_to_launch, pool_blocks_upper_bound
    from megamoe_rt.schedule.task_order import pull_cycles

    topk = min(topk, ranks * local_experts)
    full = pool_blocks_upper_bound(bound, ranks, topk, local_experts, block_m)
    ring = max(1, round(share * full))
    launched = cycles_to_launch(bound, ranks, topk, local_experts, ring, block_m)
    # Rows each local expert of this rank receives: every source rank's tokens, each reaching at
    # most one row per expert (distinct experts per token).
    rows = [0] * local_experts
    for _ in range(ranks):
        tokens = data.draw(st.integers(0, bound))
        for _ in range(tokens):
            picks = data.draw(st.sets(st.integers(0, ranks * local_experts - 1), min_size=0, max_size=topk))
            for g in picks:
                if g < local_experts:  # this rank's experts are the first local_experts ids
                    rows[g] += 1
    blocks = [-(-r // block_m) for r in rows]
    cycles = pull_cycles(blocks, ring, launched)  # raises if the pool needs more cycles
    assert len(cycles) == launched
    assert sorted(b for c in cycles for b in c) == sorted((e, b) for e, n in enumerate(blocks) for b in range(n))
