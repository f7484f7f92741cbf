"""Property tests of the cross-rank protocol model (megamoe_rt/schedule/ep_protocol.py), CPU only."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.ep_protocol import EpModel, ProtocolViolation


def _random_run(model: EpModel, seed: int) -> None:
    rng = random.Random(seed)
    model.run(lambda ready: rng.choice(ready))


@settings(max_examples=400, deadline=None)
@given(ranks=st.integers(1, 8), launches=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_parity_banks_never_show_a_reader_words_of_another_launch(ranks, launches, seed):
    model = EpModel(ranks, launches)
    _random_run(model, seed)
    assert model.all_done()


@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(2, 6), launches=st.integers(2, 6), lead=st.integers(0, 7))
def test_one_rank_racing_ahead_cannot_overrun_a_slow_one(ranks, launches, lead):
    # Always move the fastest eligible rank (lowest index first), a slow rank only when forced.
    model = EpModel(ranks, launches)
    model.run(lambda ready: min(ready, key=lambda r: (r != lead % ranks, r)))
    assert model.all_done()


def _finds_violation(model_factory, tries: int = 300) -> bool:
    for seed in range(tries):
        try:
            _random_run(model_factory(), seed)
        except ProtocolViolation:
            return True
    return False


def test_one_bank_is_unsafe():
    # Without launch parity a fast rank's next-launch counts land in a bank a slow rank is
    # still clearing or reading: the model finds the stale or lost write.
    assert _finds_violation(lambda: EpModel(3, 3, banks=1))


def test_two_banks_without_clearing_are_unsafe():
    assert _finds_violation(lambda: EpModel(3, 4, clear_other_bank=False))


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_withholding_its_signal_stalls_every_rank(ranks):
    # What the device deadlines turn into a trap naming the peer: without them, a hang.
    model = EpModel(ranks, 2, withhold=ranks - 1)
    with pytest.raises(ProtocolViolation, match="deadlock"):
        _random_run(model, 0)
    stuck = [(s.launch, s.step) for s in model.ranks]
    assert all(launch == 0 for launch, _ in stuck)


def test_bad_arguments():
    with pytest.raises(ValueError):
        EpModel(0, 1)
    model = EpModel(2, 1)
    for _ in range(3):  # clear, then publish to ranks 0 and 1
        model.step(0)
    with pytest.raises(ValueError, match="cannot step"):
        model.step(0)  # gather waits for rank 1's counts


@pytest.mark.parametrize("ranks,experts", [(2, 16), (4, 256), (8, 384)])
def test_the_kernels_bank_layout_matches_the_buffer_region(ranks, experts):
    from megamoe_rt.kernels.ep import bank_layout
    from megamoe_rt.schedule.layout import symm_buffer_layout

    lay = symm_buffer_layout(512, 256, experts, 4, 256, ranks)
    el = experts // ranks
    bank = bank_layout(ranks, el)
    assert lay.workspace_region("ep_banks").shape == (2, bank.words)
    # recv_counts | recv_offsets | count_ready | combine_ready | pool_cycles, back to back, nothing
    # past the end.
    assert (bank.recv_counts, bank.recv_offsets, bank.count_ready, bank.combine_ready, bank.pool_cycles) == (
        0,
        ranks * el,
        2 * ranks * el,
        2 * ranks * el + ranks,
        2 * ranks * el + 2 * ranks,
    )
    assert bank.pool_cycles + 1 == bank.words
    assert lay.workspace_region("ep_src_rows").shape == (el, ranks + 1)
    assert lay.region("send_list").shape == (lay.num_max_tokens_per_rank * 4,)
