"""The status board's slots: parity, torn payloads, the gone flag (one process, CPU)."""

from __future__ import annotations

import pytest

from megamoe_rt.ep import board


@pytest.fixture
def two(tmp_path):
    path = str(tmp_path / "board")
    board.create(path, 2)
    b = board.StatusBoard(path, 2)
    yield b
    b.close()


def test_an_exchange_completes_once_every_rank_posted(two):
    two.post(0, 1, b"a")
    with pytest.raises(TimeoutError, match="rank 1 did not take part"):
        two.gather(1, 0.01, "x")
    two.post(1, 1, b"b")
    assert two.gather(1, 0.01, "x") == [b"a", b"b"]


def test_consecutive_exchanges_use_their_own_slot(two):
    for r in (0, 1):
        two.post(r, 1, b"one-%d" % r)
        two.post(r, 2, b"two-%d" % r)
    assert two.gather(1, 0.01, "x") == [b"one-0", b"one-1"]
    assert two.gather(2, 0.01, "x") == [b"two-0", b"two-1"]


def test_a_torn_payload_is_not_taken(two):
    two.post(0, 3, b"whole payload")
    two.post(1, 3, b"other")
    off = two._offset(0, 3) + board._PAYLOAD_AT
    two._map[off : off + 5] = b"TORN!"  # the header says seq 3, the bytes do not match its CRC
    with pytest.raises(TimeoutError, match="rank 0 did not take part"):
        two.gather(3, 0.01, "x")


def test_a_rank_marked_gone_fails_the_exchange(two):
    two.post(1, 1, b"b")
    two.mark_gone(0)
    with pytest.raises(board.RankGone, match="rank 0 ended without taking part"):
        two.gather(1, 5.0, "x")


def test_oversized_payloads_are_refused(two):
    with pytest.raises(ValueError, match="exceeds"):
        two.post(0, 1, b"x" * (board.MAX_PAYLOAD + 1))


def _hammer(path, rank, rounds, queue):
    import random
    import time

    b = board.StatusBoard(path, 3)
    rng = random.Random(rank)
    wrong = []
    for i in range(1, rounds + 1):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.001)
        b.post(rank, i, (f"{rank}:{i}" * (1 + i % 7)).encode())
        got = b.gather(i, 30, "stress")
        if got != [(f"{r}:{i}" * (1 + i % 7)).encode() for r in range(3)]:
            wrong.append((i, got))
    queue.put((rank, wrong[:3]))


def test_three_processes_never_read_a_slot_half_written(tmp_path):
    """A header packed in one go showed the new sequence number next to a zeroed length for a
    moment, and readers took an empty payload: every exchange must come back whole."""
    import multiprocessing as mp

    path = str(tmp_path / "board")
    board.create(path, 3)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(path, r, 1500, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    assert results == {0: [], 1: [], 2: []}


def test_an_older_exchange_s_whole_payload_is_not_taken_for_a_newer_one(two):
    """What weakly ordered stores can show: exchange 5's sequence number next to exchange 3's
    complete header and payload in the same slot."""
    import struct

    two.post(0, 3, b"old")
    off = two._offset(0, 5)
    struct.pack_into("<Q", two._map, off, 5)
    assert two._read(0, 5) is None


def test_a_rank_that_posted_and_then_ended_is_not_counted_missing(two):
    two.post(0, 1, b"a")
    two.mark_gone(0)  # posted, finished its own gather, exited
    two.post(1, 1, b"b")
    assert two.gather(1, 0.01, "x") == [b"a", b"b"]
