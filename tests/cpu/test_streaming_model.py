"""Property tests of the streaming input ring protocol (megamoe_rt/schedule/streaming.py), CPU model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule.streaming import ProtocolViolation, RingModel, chunk_generation, encode_gen


def _run(model: RingModel, choices) -> None:
    """Drive the model with a chooser; fail on a deadlock (nothing runnable, not done)."""
    i = 0
    while not model.done:
        ready = model.runnable()
        if not ready:
            raise AssertionError(f"deadlock: nothing can step (chunks {model.num_chunks}, slots {model.num_slots})")
        model.step(ready[choices(i, len(ready))])
        i += 1


@settings(max_examples=200, deadline=None)
@given(
    ranks=st.integers(1, 4), slots=st.integers(1, 4), chunks=st.integers(0, 12), calls=st.integers(1, 3), data=st.data()
)
def test_no_stale_reads_no_lost_payloads_across_wraps_and_replays(ranks, slots, chunks, calls, data):
    model = RingModel(ranks, slots, chunks, epoch=7)
    for call in range(calls):
        if call:
            model.start_call(7 + call)  # a replay: same ring state, next epoch
        _run(model, lambda i, n: data.draw(st.integers(0, n - 1), label=f"step{call}.{i}"))  # noqa: B023 (_run calls it in this iteration)
        assert len(model.reads) == ranks * chunks * (call + 1)


@pytest.mark.parametrize("ranks,slots,chunks", [(1, 1, 5), (3, 2, 9), (2, 4, 3)])
def test_serialized_execution_stays_correct(ranks, slots, chunks):
    """Correctness must not depend on overlap: always step the lowest-numbered actor."""
    model = RingModel(ranks, slots, chunks)
    _run(model, lambda i, n: 0)
    model.start_call(2)
    _run(model, lambda i, n: n - 1)


def test_an_empty_rank_does_not_block_the_others():
    model = RingModel(3, 2, 0)
    assert model.done and model.runnable() == []


def test_generations_without_an_epoch_are_caught_on_replay():
    """The reason for the epoch: with sequence-only generations, a replay's consumer accepts
    the previous call's publish of the same chunk and reads a stale slot."""
    model = RingModel(1, 2, 2, gen_of=lambda epoch, chunk: chunk + 1)
    _run(model, lambda i, n: 0)
    model.start_call(2)
    with pytest.raises(ProtocolViolation, match="holds"):
        model.step("consumer")  # ready words still read as chunk 0: it goes ahead
        model.step("consumer")


def test_generation_encoding():
    g = encode_gen(3, 5)
    assert g >> 32 == 3 and g & 0xFFFFFFFF == 5
    assert chunk_generation(3, 0) == encode_gen(3, 1) != chunk_generation(4, 0)
    with pytest.raises(ValueError):
        encode_gen(1, 0)
