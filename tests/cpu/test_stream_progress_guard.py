"""The host-side guard against a producer that could only run after the streamed call waiting
for it (docs/STREAMING.md, "Progress"): which stream pairs serialise, and when InputRing refuses
producer work, on the CPU with the driver stood in for."""

from __future__ import annotations

import pytest

from megamoe_rt.kernels import stream as sk
from megamoe_rt.runtime import driver, streams

NON_BLOCKING, BLOCKING = 0x1001, 0x2002  # stream handles with and without CU_STREAM_NON_BLOCKING


@pytest.fixture
def flags(monkeypatch):
    from cuda.bindings import driver as cu

    nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def fake_call(fn, *args):
        assert fn is cu.cuStreamGetFlags
        return {NON_BLOCKING: nb, BLOCKING: 0}[args[0]]

    monkeypatch.setattr(driver, "call", fake_call)


@pytest.mark.parametrize(
    "a,b,serialise",
    [
        (NON_BLOCKING, NON_BLOCKING, True),  # the same stream
        (NON_BLOCKING, BLOCKING, False),
        (0, NON_BLOCKING, False),  # legacy and a non-blocking stream run side by side
        (0, BLOCKING, True),  # a blocking stream waits for the legacy stream and the reverse
        (BLOCKING, 1, True),
        (0, 2, True),  # the per-thread default stream synchronises with the legacy one
        (0, 1, True),  # both name the legacy stream
    ],
)
def test_which_streams_serialise(flags, a, b, serialise):
    sa, sb = streams.StreamOrder.of(a), streams.StreamOrder.of(b)
    assert sa.serialises_with(sb) is serialise
    assert sb.serialises_with(sa) is serialise


def test_per_thread_default_streams_of_two_threads_run_side_by_side(flags, monkeypatch):
    import threading

    mine = streams.StreamOrder.of(2)
    theirs: list = []
    t = threading.Thread(target=lambda: theirs.append(streams.StreamOrder.of(2)))
    t.start()
    t.join()
    assert mine.serialises_with(streams.StreamOrder.of(2))  # this thread's own, twice
    assert not mine.serialises_with(theirs[0])
    assert mine.serialises_with(streams.StreamOrder.of(0))  # and each waits for the legacy stream
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    assert streams.StreamOrder.of(0).kind == "per_thread"  # 0 names it in this mode


class _Event:
    def __init__(self, **kw):
        self.done = False

    def record(self, stream):
        self.done = False
        return self


@pytest.fixture
def ring(monkeypatch, flags):
    capturing: set[int] = set()
    monkeypatch.setattr(streams, "stream_is_capturing", lambda s: s in capturing)
    monkeypatch.setattr(streams, "Event", _Event)
    r = object.__new__(sk.InputRing)
    r.device = 0
    r._producer_calls = r._consumer_calls = 0
    r._consumer_stream, r._consumer_done, r._awaited_call, r._untracked = None, None, None, False
    launched = []
    monkeypatch.setattr(r, "_launch", lambda name, params, stream, grid=1: launched.append((name, stream)))
    monkeypatch.setattr(r, "params", lambda *a, **k: None)
    return r, launched, capturing


@pytest.mark.parametrize("consumer,producer", [(NON_BLOCKING, NON_BLOCKING), (BLOCKING, 0), (0, BLOCKING)])
def test_a_producer_behind_the_call_waiting_for_it_is_refused_before_any_launch(ring, consumer, producer):
    r, launched, _ = ring
    r.note_consumer(consumer)  # consume(..., stream=consumer), nothing produced for it yet
    with pytest.raises(ValueError, match="deadlock"):
        r.begin_call(producer)  # a ChunkWriter or Router on a stream that waits behind the call
    assert launched == []


def test_a_producer_on_a_stream_that_runs_beside_the_call_is_accepted(ring):
    r, launched, _ = ring
    r.note_consumer(0)  # the call on the legacy stream
    r.begin_call(NON_BLOCKING)
    r.check_producer(NON_BLOCKING)
    assert launched == [("stream_begin_call", NON_BLOCKING)]


def test_a_producer_ahead_of_the_call_on_its_stream_is_accepted_call_after_call(ring):
    r, launched, _ = ring
    for _ in range(3):
        r.begin_call(BLOCKING)  # produce, then consume, on one stream: correct, no overlap
        r.check_producer(BLOCKING)
        r.note_consumer(BLOCKING)
    assert len(launched) == 3


def test_a_finished_call_no_longer_blocks_its_stream(ring):
    r, launched, _ = ring
    r.note_consumer(BLOCKING)
    r._consumer_done.done = True  # the call has completed (its producer came another way)
    r.begin_call(BLOCKING)
    assert launched == [("stream_begin_call", BLOCKING)]


def test_after_a_capture_the_guard_stands_down(ring):
    r, launched, capturing = ring
    capturing.add(NON_BLOCKING)
    r.begin_call(NON_BLOCKING)  # captured: replays will move the ring without the host
    r.note_consumer(BLOCKING)
    r.begin_call(BLOCKING)  # not checked any more: never a false refusal
    assert [s for _, s in launched] == [NON_BLOCKING, BLOCKING]


def test_a_producer_being_captured_is_never_refused(ring):
    r, launched, capturing = ring
    r.note_consumer(0)  # an eager call on the legacy stream waits for its producer
    capturing.add(BLOCKING)
    r.begin_call(BLOCKING)  # captured: it runs where the graph is launched, not behind the call
    assert launched == [("stream_begin_call", BLOCKING)]
