"""The call-wide pool for streamed calls (reservations and a seal), on the CPU model: every
interleaving of producers, dispatch workers and GEMM workers, on one rank or across ranks, ends
with the batch call's output, the batch call's pool blocks and no deadlock; the early seals
compute blocks with rows missing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.stream_seal import (
    SEAL_AFTER_OWN_CHUNKS,
    SEAL_AFTER_PUBLISH,
    SealedTooEarly,
    SealModel,
    batch_blocks,
    batch_output,
)


@st.composite
def routings(draw, max_ranks=3):
    ranks = draw(st.integers(1, max_ranks))
    per_rank = draw(st.integers(1, 4))
    experts = ranks * per_rank
    k = draw(st.integers(1, min(4, experts)))
    out = []
    for _ in range(ranks):
        tokens = draw(st.integers(0, 40))
        rows = []
        for _ in range(tokens):
            picked = draw(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k, unique=True))
            rows.append([e if draw(st.integers(0, 19)) else -1 for e in picked])  # some slots dropped
        out.append(rows)
    return per_rank, out


@settings(max_examples=300, deadline=None)
@given(
    routing=routings(),
    chunk=st.integers(1, 16),
    slots=st.integers(1, 4),
    block_rows=st.integers(1, 8),
    seed=st.integers(0, 2**31),
)
def test_every_interleaving_gives_the_batch_output_with_the_batch_pool(routing, chunk, slots, block_rows, seed):
    per_rank, rows = routing
    model = SealModel(rows, per_rank, chunk, slots, block_rows)
    y = model.run(random.Random(seed))
    assert y == batch_output(rows)  # bit for bit: slot-order sums of the same row partials
    assert [len(o.blocks) for o in model.owners] == batch_blocks(rows, per_rank, block_rows)
    for o, own in enumerate(model.owners):
        for b in own.blocks:
            assert b.computed and b.written == len(b.rows) <= block_rows
            assert model.owner_of(b.expert) == o
            assert {rows[s][t][k] for s, t, k in b.rows} == {b.expert}  # one expert a block
    placed = sorted(r for own in model.owners for b in own.blocks for r in b.rows)
    routed = sorted(
        (s, t, k) for s, rs in enumerate(rows) for t, row in enumerate(rs) for k, e in enumerate(row) if e >= 0
    )
    assert placed == routed  # each pair exactly once


def test_a_full_block_is_computed_before_the_call_is_sealed():
    # One rank, one expert, 4-row blocks, chunks of 4 tokens: block 0 is full once chunk 0 is
    # in, and the GEMMs take it while later chunks are still to be produced.
    model = SealModel([[[0]] * 12], 1, chunk=4, slots=2, block_rows=4)
    model.publish(0)
    model.start(0, 0)
    for _ in range(4):
        model.reserve(0, 0)
        model.write(0, 0)
    assert model.owners[0].ready == [0] and not model.owners[0].sealed
    model.compute(0, 0)
    assert model.combined == [1]  # chunk 0's tokens are combined before the call is sealed


@pytest.mark.parametrize(
    "policy,rows",
    [
        (SEAL_AFTER_PUBLISH, [[[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]]]),
        (SEAL_AFTER_OWN_CHUNKS, [[[0], [1]], [[0], [1], [0], [1], [0], [1]]]),  # rank 1 still sends to rank 0
    ],
)
def test_an_early_seal_computes_blocks_with_rows_missing(policy, rows):
    per_rank = 2 if len(rows) == 1 else 1
    failures = 0
    for seed in range(200):
        model = SealModel(rows, per_rank, chunk=1, slots=2, block_rows=4, seal=policy)
        try:
            model.run(random.Random(seed))
        except SealedTooEarly:
            failures += 1
    assert failures > 0


def test_a_producer_never_waits_on_the_gemms():
    # Slots are released once a chunk's rows are in the pool: with no GEMM step taken, a rank
    # publishes every chunk through a single slot.
    model = SealModel([[[0]] * 9], 1, chunk=1, slots=1, block_rows=4)
    for _ in range(9):
        assert model.can_publish(0)
        model.publish(0)
        model.start(0, 0)
        model.reserve(0, 0)
        model.write(0, 0)
    assert model.published == [9] and model.owners[0].sealed and len(model.owners[0].ready) == 3


def test_across_ranks_a_slot_is_reused_only_after_every_owner_copied_it():
    # Rank 0's chunk 0 goes to experts on both ranks; with one slot, its chunk 1 waits until
    # both owners have copied chunk 0, and not a step longer.
    model = SealModel([[[0, 1], [1, 0]], []], 1, chunk=1, slots=1, block_rows=4)
    model.publish(0)
    model.start(0, 0)
    model.reserve(0, 0)
    model.write(0, 0)
    assert not model.can_publish(0)  # owner 1 has not copied its row of chunk 0
    model.start(1, 0)
    model.reserve(1, 0)
    model.write(1, 0)
    assert model.can_publish(0)


@pytest.mark.parametrize("tokens", [(0, 0), (0, 5), (1, 0)])
def test_ranks_without_tokens_finish(tokens):
    rows = [[[0, 1]] * n for n in tokens]
    model = SealModel(rows, 1, chunk=4, slots=2, block_rows=4)
    assert model.run(random.Random(0)) == batch_output(rows)
