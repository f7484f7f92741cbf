"""The call-wide pool for streamed calls (reservations and a seal), on the CPU model: every
interleaving of producer, dispatch workers and GEMM workers ends with the batch call's output,
the batch call's pool blocks and no deadlock; sealing at the last publish instead of the last
dispatch computes blocks with rows missing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.stream_seal import (
    SEAL_AFTER_PUBLISH,
    SealedTooEarly,
    SealModel,
    batch_blocks,
    batch_output,
)


@st.composite
def routings(draw):
    experts = draw(st.integers(1, 6))
    k = draw(st.integers(1, min(4, experts)))
    tokens = draw(st.integers(0, 60))
    rows = []
    for _ in range(tokens):
        picked = draw(st.lists(st.integers(0, experts - 1), min_size=k, max_size=k, unique=True))
        rows.append([e if draw(st.integers(0, 19)) else -1 for e in picked])  # some slots dropped
    return experts, rows


@settings(max_examples=300, deadline=None)
@given(
    routing=routings(),
    chunk=st.integers(1, 16),
    slots=st.integers(1, 4),
    block_rows=st.integers(1, 8),
    workers=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_every_interleaving_gives_the_batch_output_with_the_batch_pool(
    routing, chunk, slots, block_rows, workers, seed
):
    experts, rows = routing
    model = SealModel(rows, experts, chunk, slots, block_rows, workers=workers)
    y = model.run(random.Random(seed))
    assert y == batch_output(rows)  # bit for bit: slot-order sums of the same row partials
    assert len(model.blocks) == batch_blocks(rows, experts, block_rows)
    assert all(b.computed and b.written == len(b.rows) <= block_rows for b in model.blocks)
    assert all(len({model.topk_idx[t][k] for t, k in b.rows}) == 1 for b in model.blocks)  # one expert a block
    routed = sorted((t, k) for t, row in enumerate(rows) for k, e in enumerate(row) if e >= 0)
    assert sorted(r for b in model.blocks for r in b.rows) == routed  # each pair exactly once


def test_a_full_block_is_computed_before_the_call_is_sealed():
    # One expert, 4-row blocks, chunks of 4 tokens: block 0 is full once chunk 0 is in, and
    # the GEMMs can take it while later chunks are still being produced.
    rows = [[0]] * 12
    model = SealModel(rows, 1, chunk=4, slots=2, block_rows=4, workers=1)
    model.publish()
    model.start_chunk()
    for _ in range(4):
        model.reserve(0)
        model.write(0)
    assert model.ready == [0] and not model.sealed
    model.compute(0)
    assert model.combined == [0]  # chunk 0's tokens are combined before the call is sealed


def test_sealing_at_the_last_publish_computes_blocks_with_rows_missing():
    failures = 0
    for seed in range(200):
        rows = [[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]]
        model = SealModel(rows, 2, chunk=2, slots=3, block_rows=4, workers=2, seal=SEAL_AFTER_PUBLISH)
        try:
            model.run(random.Random(seed))
        except SealedTooEarly:
            failures += 1
    assert failures > 0


def test_a_producer_never_waits_on_the_gemms():
    # Slots are released when a chunk's rows are in the pool: with no GEMM step taken, the
    # producer still publishes every chunk through a single slot.
    rows = [[0]] * 9
    model = SealModel(rows, 1, chunk=1, slots=1, block_rows=4, workers=1)
    for _ in range(9):
        assert model.can_publish()
        model.publish()
        model.start_chunk()
        model.reserve(0)
        model.write(0)
    assert model.published == 9 and model.sealed and len(model.ready) == 3


@pytest.mark.parametrize("tokens", [0, 1])
def test_empty_and_single_token_calls_finish(tokens):
    rows = [[0, -1]] * tokens
    model = SealModel(rows, 2, chunk=4, slots=2, block_rows=4)
    assert model.run(random.Random(0)) == batch_output(rows)
