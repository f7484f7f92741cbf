"""The split pipeline's protocol between K1, K2 and K3 (megamoe_rt/schedule/split_protocol.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.split_protocol import ProtocolViolation, SplitModel

blocks = st.lists(st.integers(1, 6), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(blocks, st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_any_interleaving_of_any_replay_completes_and_reads_only_its_own_data(tiles, k1, k2, seed, replays):
    rng = random.Random(seed)
    model = SplitModel(tiles, k1, k2)
    for _ in range(replays):
        model.run_replay(rng.choice)  # raises on a stale read, a deadlock or an early K3


@settings(max_examples=100, deadline=None)
@given(blocks, st.integers(1, 4), st.integers(1, 4))
def test_k2_waits_for_every_l1_tile_of_a_block(tiles, k1, k2):
    model = SplitModel(tiles, k1, k2)
    model.start_replay()
    assert not any(kernel == "k2" for kernel, _ in model.runnable())  # nothing ready yet
    # K1 does all but one tile of block 0: K2's worker for block 0 still waits.
    for _ in range(tiles[0] - 1):
        worker = next(w for w in range(k1) if model._k1_queue[w] and model._k1_queue[w][0][0] == 0)
        model.step_k1(worker)
    assert not model.can_step_k2(0)


def test_without_the_memset_node_a_replay_reads_the_previous_replay_s_output():
    model = SplitModel([2, 3], k1_workers=1, k2_workers=1, reset_on_replay=False)
    model.run_replay(lambda options: options[0])
    model.start_replay()
    # The counts of replay 1 already reach the target: K2 may go before K1 wrote anything.
    assert model.can_step_k2(0)
    with pytest.raises(ProtocolViolation, match="before this replay wrote them"):
        model.step_k2(0)


def test_k3_runs_only_after_both_kernels():
    model = SplitModel([1], k1_workers=1, k2_workers=1)
    model.start_replay()
    with pytest.raises(ProtocolViolation, match="before K1 and K2 finished"):
        model.run_k3()


def test_each_kernel_needs_a_partition():
    with pytest.raises(ValueError, match="at least one worker"):
        SplitModel([1], k1_workers=1, k2_workers=0)
