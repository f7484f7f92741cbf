"""A status board the ranks of one host share: a fast all-gather of small payloads.

The launcher creates one file per launch in its private directory; every rank maps it. Each
rank owns two slots (by the parity of the exchange's sequence number) and posts into them;
an exchange is complete for a rank once every rank's slot of that parity carries the
exchange's sequence number. Two slots suffice: a rank can only post exchange ``n + 2`` after
exchange ``n + 1`` completed, and that needs every rank to have finished reading exchange ``n``.

No lock is taken. A writer stores the payload, then its length and CRC-32, and the sequence
number last, each field group with its own store (``struct.pack_into`` zero-fills what it
packs before writing it, so a header packed in one go would show the new sequence number
next to a zeroed length for a moment). A reader takes a slot seqlock-style (sequence, header,
payload, then sequence and header again) and checks a CRC over sequence, length and payload,
so it never takes a half-written payload, or an older exchange's, for this exchange's, also on
hosts with weaker store ordering than x86. The launcher
marks a rank that has ended in a word of its own, and an exchange waiting for it fails at once.
The word says how the rank ended: it left (:data:`ENDED`), its process died (:data:`DIED`), or
it stopped answering its heartbeat (:data:`STALLED`, megamoe_rt/ep/liveness.py).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import zlib

SLOT_BYTES = 4096
_SEQ = struct.Struct("<Q")  # at the slot's start: the exchange the slot holds
_META = struct.Struct("<II")  # after it: payload length, CRC-32 of the payload
_PAYLOAD_AT = _SEQ.size + _META.size
MAX_PAYLOAD = SLOT_BYTES - _PAYLOAD_AT
_GONE = struct.Struct("<Q")  # one word per rank past the slots: nonzero once the rank ended
# What a rank's gone word holds: how it ended (0: it has not).
ENDED, DIED, STALLED = 1, 2, 3
_HOW = {ENDED: "ended", DIED: "died", STALLED: "stopped responding"}
_SPIN_S = 0.002  # spin this long before sleeping between looks


class RankGone(RuntimeError):
    """A rank ended while others waited for it in an exchange; ``how`` is its gone word
    (:data:`ENDED`, :data:`DIED` or :data:`STALLED`)."""

    def __init__(self, message: str, rank: int = -1, how: int = ENDED):
        super().__init__(message)
        self.rank = rank
        self.how = how


def _checksum(seq: int, payload: bytes) -> int:
    """CRC-32 over the sequence number, the length and the payload: a whole payload of an older
    exchange next to a newer sequence number (weakly ordered stores) does not pass either."""
    return zlib.crc32(struct.pack("<QI", seq, len(payload)) + payload)


def create(path: str, world_size: int) -> None:
    """The launcher's side: a zeroed board for ``world_size`` ranks, readable by the user only."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, _size(world_size))
    finally:
        os.close(fd)


def _size(world_size: int) -> int:
    return world_size * 2 * SLOT_BYTES + world_size * _GONE.size


class StatusBoard:
    def __init__(self, path: str, world_size: int):
        self.world_size = world_size
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _size(world_size))
        finally:
            os.close(fd)

    def _offset(self, rank: int, seq: int) -> int:
        return (rank * 2 + seq % 2) * SLOT_BYTES

    def post(self, rank: int, seq: int, payload: bytes) -> None:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"board payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
        off = self._offset(rank, seq)
        self._map[off + _PAYLOAD_AT : off + _PAYLOAD_AT + len(payload)] = payload
        _META.pack_into(self._map, off + _SEQ.size, len(payload), _checksum(seq, payload))
        _SEQ.pack_into(self._map, off, seq)  # last: readers take the slot from here on

    def _read(self, rank: int, seq: int) -> bytes | None:
        off = self._offset(rank, seq)
        if _SEQ.unpack_from(self._map, off)[0] != seq:
            return None
        length, crc = _META.unpack_from(self._map, off + _SEQ.size)
        if length > MAX_PAYLOAD:
            return None
        payload = bytes(self._map[off + _PAYLOAD_AT : off + _PAYLOAD_AT + length])
        if (
            _SEQ.unpack_from(self._map, off)[0] != seq
            or _META.unpack_from(self._map, off + _SEQ.size) != (length, crc)
            or _checksum(seq, payload) != crc
        ):
            return None
        return payload

    def _gone_at(self, rank: int) -> int:
        return self.world_size * 2 * SLOT_BYTES + rank * _GONE.size

    def gone(self, rank: int) -> int:
        """How ``rank`` ended (:data:`ENDED`, :data:`DIED`, :data:`STALLED`), 0 while it runs."""
        return int(_GONE.unpack_from(self._map, self._gone_at(rank))[0])

    def mark_gone(self, rank: int, how: int = ENDED) -> None:
        """The launcher's (or the hub's) side: ``rank`` has ended, ``how``; the first word
        written stays (a rank declared dead is not later taken for one that left)."""
        if how not in _HOW:
            raise ValueError(f"how: expected one of {sorted(_HOW)}, got {how!r}")
        if not self.gone(rank):
            _GONE.pack_into(self._map, self._gone_at(rank), how)

    def gather(self, seq: int, timeout_s: float, what: str) -> list[bytes]:
        """Every rank's payload of exchange ``seq``, in rank order, once all have posted."""
        out: list[bytes | None] = [None] * self.world_size
        start = time.monotonic()
        while True:
            # The gone words first: a rank marked gone before its slot was read, whose slot
            # still lacks this exchange, never posted it (it posts before it can end).
            gone = [self.gone(r) for r in range(self.world_size)]
            for r in range(self.world_size):
                if out[r] is None:
                    out[r] = self._read(r, seq)
            missing = [r for r, v in enumerate(out) if v is None]
            if not missing:
                return [v for v in out if v is not None]
            dead = [r for r in missing if gone[r]]
            if dead:
                r = dead[0]
                how = gone[r] if gone[r] in _HOW else ENDED
                raise RankGone(f"{what}: rank {r} {_HOW[how]} without taking part", r, how)
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise TimeoutError(f"{what}: rank {missing[0]} did not take part within {timeout_s:g} s")
            if waited > _SPIN_S:
                time.sleep(min(0.001, waited / 10))

    def close(self) -> None:
        self._map.close()
