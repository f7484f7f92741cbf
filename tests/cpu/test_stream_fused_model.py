"""The fused kernel's streamed consumer, modelled on the CPU (megamoe_rt/schedule/stream_fused.py):
blocks go to L1 as chunks fill them, tickets follow a lag order over blocks in completion order,
and every wait ends while the producer has an SM of its own."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.stream_fused import (
    FusedStreamModel,
    ProducerStarved,
    _open_order,
    batch_output_one_rank,
    lag_order,
    ticket_task,
)


def _routing(rng: random.Random, tokens: int, topk: int, experts: int, skew: float) -> list[list[int]]:
    """Top-k rows over ``experts``; ``skew`` > 0 sends most pairs to the first few experts;
    some slots are dropped (-1)."""
    rows = []
    for _ in range(tokens):
        picks: list[int] = []
        while len(picks) < topk:
            e = int(rng.random() ** (1 + skew * 4) * experts)
            if e not in picks:
                picks.append(e)
        rows.append([-1 if rng.random() < 0.05 else e for e in picks])
    return rows


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    tokens=st.integers(0, 90),
    chunk=st.integers(1, 24),
    slots=st.integers(1, 4),
    block_rows=st.sampled_from([2, 4, 8]),
    grid=st.integers(1, 6),
    lag=st.integers(0, 3),
    skew=st.floats(0, 1),
)
def test_a_streamed_call_gives_the_batch_output_under_any_interleaving(
    seed, tokens, chunk, slots, block_rows, grid, lag, skew
):
    rng = random.Random(seed)
    routing = _routing(rng, tokens, 3, 6, skew)
    model = FusedStreamModel(routing, chunk, slots, block_rows, grid=grid, sms=grid + 1, lag=lag)
    assert model.run(rng) == batch_output_one_rank(routing)
    # The blocks are the batch pool's: each expert's rows in ceil(rows / block_rows) blocks.
    per_expert: dict[int, int] = {}
    for row in routing:
        for e in row:
            if e >= 0:
                per_expert[e] = per_expert.get(e, 0) + 1
    assert len(model.blocks) == sum(-(-n // block_rows) for n in per_expert.values())


def test_a_grid_on_every_sm_leaves_the_producer_none():
    rng = random.Random(1)
    routing = _routing(rng, 40, 2, 4, 0.0)
    model = FusedStreamModel(routing, chunk=8, slots=2, block_rows=4, grid=4, sms=4)
    with pytest.raises(ProducerStarved, match="leave the producer none"):
        model.run(rng)


def test_full_blocks_reach_l1_before_the_last_chunk_is_published():
    """Routing that fills blocks early (two experts) over many chunks, with a producer slower
    than everything else: L1 runs on full blocks while chunks are still to come."""
    rng = random.Random(7)
    routing = [[t % 2] for t in range(64)]
    model = FusedStreamModel(routing, chunk=4, slots=2, block_rows=8, grid=3, sms=4)
    assert model.run(rng, slow_producer=True) == batch_output_one_rank(routing)
    assert 0 <= model.first_l1_step < model.last_publish_step


@pytest.mark.parametrize("lag", [0, 1, 2, 5])
def test_the_open_order_is_the_sealed_order_up_to_the_last_l1(lag):
    """Tickets taken before the seal keep their task in the sealed order up to the last L1 and
    the L2 after it; only the tail differs. Each task appears once, every L2 after its L1."""
    for positions in range(0, 12):
        sealed = lag_order(positions, lag)
        assert sorted(sealed) == sorted([("l1", j) for j in range(positions)] + [("l2", j) for j in range(positions)])
        assert all(sealed.index(("l1", j)) < sealed.index(("l2", j)) for j in range(positions))
        opened = _open_order(positions + lag + 3, lag)
        last_l1 = max((i for i, t in enumerate(sealed) if t[0] == "l1"), default=-1)
        common = last_l1 + (2 if positions > lag else 1)
        assert sealed[:common] == opened[:common]


def test_an_l2_ticket_waits_for_its_place_in_the_order_before_the_seal():
    """Two full blocks arrive early and the last chunk (every slot dropped) late. Before the seal
    the open-ended order puts L2 of the second block after a third block's L1, a place the sealed
    order gives to something else; a worker holding that ticket must wait for the seal rather than
    run it (the model raises if any task runs twice or not at all)."""
    routing = [[0]] * 8 + [[-1]] * 4
    for seed in range(20):
        model = FusedStreamModel(routing, chunk=4, slots=3, block_rows=4, grid=4, sms=5, lag=1)
        assert model.run(random.Random(seed), slow_producer=True) == batch_output_one_rank(routing)


def _expanded(tasks: list[tuple[str, int]], l1_tiles: int, l2_tiles: int) -> list[tuple[str, int, int]]:
    return [(kind, j, i) for kind, j in tasks for i in range(l1_tiles if kind == "l1" else l2_tiles)]


@settings(max_examples=300, deadline=None)
@given(
    lag=st.integers(0, 6),
    l1_tiles=st.integers(1, 5),
    l2_tiles=st.integers(1, 5),
    positions=st.integers(0, 20),
)
def test_the_closed_form_ticket_is_the_expanded_order(lag, l1_tiles, l2_tiles, positions):
    """The device's O(1) ticket -> task (ticket_task, mirrored by cuda_src/fused/stream_order.cuh)
    against the orders expanded task by task: the sealed one to its end and one past it, the open
    one as far as ``positions`` positions reach."""
    sealed = _expanded(lag_order(positions, lag), l1_tiles, l2_tiles)
    for t, want in enumerate(sealed):
        assert ticket_task(t, lag, l1_tiles, l2_tiles, positions) == want
    assert ticket_task(len(sealed), lag, l1_tiles, l2_tiles, positions) is None
    opened = _expanded(_open_order(positions, lag), l1_tiles, l2_tiles)
    for t, want in enumerate(opened):
        assert ticket_task(t, lag, l1_tiles, l2_tiles) == want


def test_before_the_seal_workers_wait_on_positions_past_the_whole_pool():
    """Three tokens over three experts fill at most three blocks (one per expert), but ten
    workers at lag 6 take tickets whose positions run to 7 before the seal: the device's ready
    list, sized for the worst-case pool, must read such a position as "not there" and wait for
    the seal instead (ReadyBlocks::capacity), never read past its end."""
    routing = [[0, 1], [1, 2], [0, 2]]
    worst_case_blocks = 3
    model = FusedStreamModel(routing, chunk=1, slots=2, block_rows=4, grid=10, sms=11, lag=6, l1_tiles=1, l2_tiles=1)
    assert model.run(random.Random(2)) == batch_output_one_rank(routing)
    assert len(model.blocks) == worst_case_blocks
    assert model.max_position_waited >= worst_case_blocks
