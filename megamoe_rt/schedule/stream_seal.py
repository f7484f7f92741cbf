"""A streamed call with one call-wide pool: reservations and a seal (CPU model), on one rank
or across ranks.

A streamed call run chunk by chunk as calls of their own (chunk-local pools: across ranks and
with a ring pool) reads every local expert's weights again per chunk. This models the consumer
that reads them once per call, as the batch call does (on one rank with a full pool:
megamoe_rt/modes/stream_pool.py). Every rank produces
its own tokens' chunks into its own input ring. Rank ``o`` owns experts ``[o * E_l, (o + 1) * E_l)``.

- **Reserve.** When source ``s`` publishes chunk ``c``, each owner's dispatch workers take the
  chunk's pairs routed to its experts (the chunks of one source in order). A pair of expert
  ``e`` reserves the next row of ``e``'s open pool block on its owner. The worker that fills a
  block's last row opens the next one from the owner's block counter. A pool block therefore
  holds rows of one expert, as a grouped-GEMM m-block needs.
- **Write, then count.** The worker copies the row (over NVLink when ``s != o``) into the
  block, then adds to the block's ``written`` count (release). The block is ready once
  ``written`` reaches its size: the block size while the expert can still grow, and its
  ``reserved`` rows once the owner has sealed.
- **Release the input early.** Source ``s`` reuses chunk ``c``'s slot once every owner has
  copied the rows it needs from it, not once they are computed. Producers never wait on the
  GEMMs.
- **Seal.** An owner seals (each open partial block gets its final size) once it has dispatched
  every source's last chunk; a source's chunk count travels with its last chunk. Sealing
  earlier hands the GEMMs blocks with rows still to come (:class:`SealedTooEarly`). Two
  early seals are shown failing: at the owner's own last publish, and at the owner's own last
  chunk, ignoring the other sources.
- **Compute, scatter, combine.** GEMM workers take ready blocks in any order and send each row's
  partial back to its source. A source combines chunk ``c`` once all its routed rows' partials
  are in, summed in slot order as in the batch call.

The blocks used per expert are ``ceil(total_e / block_rows)``, exactly the batch pool's, and a
row's math does not depend on where it lands, so the output is the batch call's, bit for bit.
:class:`SealModel` runs this step by step under a random choice of the next actor; tests drive
it over random routings, chunkings, rank counts and interleavings.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from megamoe_rt.schedule.arith import ceil_div

SEAL_AFTER_DISPATCH = "after_dispatch"  # an owner seals once every source's last chunk is dispatched
SEAL_AFTER_PUBLISH = "after_publish"  # failing: a rank seals when it publishes its own last chunk
SEAL_AFTER_OWN_CHUNKS = "after_own_chunks"  # failing: an owner seals after its own source's last chunk only
SEAL_POLICIES = (SEAL_AFTER_DISPATCH, SEAL_AFTER_PUBLISH, SEAL_AFTER_OWN_CHUNKS)


class SealedTooEarly(AssertionError):
    """A block was handed to the GEMMs before all its rows were written, or an expert grew
    after its owner sealed."""


@dataclass
class Block:
    expert: int
    rows: list[tuple[int, int, int]] = field(default_factory=list)  # (source, token, slot) per reserved row
    written: int = 0
    size: int = 0  # rows that make it ready: block_rows, or the reserved rows once sealed
    queued: bool = False
    computed: bool = False


@dataclass
class _Owner:
    blocks: list[Block] = field(default_factory=list)
    open_block: dict[int, int] = field(default_factory=dict)  # expert -> its open block
    next_chunk: list[int] = field(default_factory=list)  # per source: the chunk to dispatch next
    pending: list[tuple[int, int, int, int]] = field(default_factory=list)  # (source, chunk, token, slot)
    in_flight: list[tuple[int, int, int]] = field(default_factory=list)  # (source, chunk, block) reserved
    chunk_left: dict[tuple[int, int], int] = field(default_factory=dict)  # rows of (source, chunk) not written
    sealed: bool = False
    ready: list[int] = field(default_factory=list)


@dataclass
class SealModel:
    """``topk_idx[r][t][k]``: rank ``r``'s routing, global expert ids (-1: dropped), experts
    ``[o * experts_per_rank, ...)`` owned by rank ``o``; ``chunk`` tokens per chunk through
    ``slots`` input slots per rank; ``seal`` one of :data:`SEAL_POLICIES`."""

    topk_idx: Sequence[Sequence[Sequence[int]]]
    experts_per_rank: int
    chunk: int
    slots: int
    block_rows: int
    seal: str = SEAL_AFTER_DISPATCH

    def __post_init__(self) -> None:
        r = self.ranks = len(self.topk_idx)
        self.num_chunks = [ceil_div(len(rows), self.chunk) for rows in self.topk_idx]
        self.published = [0] * r
        # Per source and slot: the chunk it holds and the owners that have not copied it yet.
        self.slot_chunk = [[-1] * self.slots for _ in range(r)]
        self.slot_readers = [[0] * self.slots for _ in range(r)]
        self.owners = [_Owner(next_chunk=[0] * r) for _ in range(r)]
        self.chunk_pending = [[0] * n for n in self.num_chunks]  # routed rows not yet computed
        for s, rows in enumerate(self.topk_idx):
            for t, row in enumerate(rows):
                self.chunk_pending[s][t // self.chunk] += sum(e >= 0 for e in row)
        self.combined = [0] * r  # chunks combined, in order
        self.partials: dict[tuple[int, int, int], float] = {}
        self.y: dict[tuple[int, int], float] = {}

    def owner_of(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def _chunk_tokens(self, source: int, c: int) -> range:
        return range(c * self.chunk, min(len(self.topk_idx[source]), (c + 1) * self.chunk))

    # --- the actors ----------------------------------------------------------------------

    def can_publish(self, s: int) -> bool:
        c = self.published[s]
        return c < self.num_chunks[s] and self.slot_readers[s][c % self.slots] == 0

    def publish(self, s: int) -> None:
        c = self.published[s]
        slot = c % self.slots
        assert self.slot_readers[s][slot] == 0, "a slot overwritten before every owner copied it"
        self.slot_chunk[s][slot] = c
        self.slot_readers[s][slot] = self.ranks  # every owner reads it (possibly for no rows)
        self.published[s] += 1
        if self.seal == SEAL_AFTER_PUBLISH and self.published[s] == self.num_chunks[s]:
            self._seal(s)

    def can_start(self, o: int, s: int) -> bool:
        own = self.owners[o]
        c = own.next_chunk[s]
        return c < self.published[s] and (s, c) not in own.chunk_left

    def start(self, o: int, s: int) -> None:
        """Owner ``o`` takes source ``s``'s next published chunk: its pairs routed to ``o``."""
        own = self.owners[o]
        c = own.next_chunk[s]
        assert self.slot_chunk[s][c % self.slots] == c, (
            f"rank {s}'s slot of chunk {c} was reused before rank {o} read it"
        )
        pairs = [
            (s, c, t, k)
            for t in self._chunk_tokens(s, c)
            for k, e in enumerate(self.topk_idx[s][t])
            if e >= 0 and self.owner_of(e) == o
        ]
        own.pending.extend(pairs)
        own.chunk_left[(s, c)] = len(pairs)
        if not pairs:
            self._chunk_copied(o, s, c)

    def can_reserve(self, o: int) -> bool:
        return bool(self.owners[o].pending)

    def reserve(self, o: int, pick: int) -> None:
        """A dispatch worker of owner ``o`` claims a row for a pair (an atomic add on the
        expert's fill); workers run in any order, so any pending pair may go next."""
        own = self.owners[o]
        s, c, t, k = own.pending.pop(pick % len(own.pending))
        e = self.topk_idx[s][t][k]
        if own.sealed:
            raise SealedTooEarly(f"rank {o}: expert {e} reserved a row (source {s} token {t}) after the seal")
        b = own.open_block.get(e, -1)
        if b < 0 or len(own.blocks[b].rows) == self.block_rows:
            b = len(own.blocks)
            own.blocks.append(Block(e, size=self.block_rows))
            own.open_block[e] = b
        own.blocks[b].rows.append((s, t, k))
        own.in_flight.append((s, c, b))

    def can_write(self, o: int) -> bool:
        return bool(self.owners[o].in_flight)

    def write(self, o: int, pick: int) -> None:
        """A reserved row is copied into its block, then counted (release)."""
        own = self.owners[o]
        s, c, b = own.in_flight.pop(pick % len(own.in_flight))
        own.blocks[b].written += 1
        self._ready_if_complete(o, b)
        own.chunk_left[(s, c)] -= 1
        if own.chunk_left[(s, c)] == 0:
            self._chunk_copied(o, s, c)

    def can_compute(self, o: int) -> bool:
        return bool(self.owners[o].ready)

    def compute(self, o: int, pick: int) -> None:
        """A GEMM worker of ``o`` takes any ready block, runs L1 and L2 over its rows and sends
        each partial back to its source."""
        own = self.owners[o]
        b = own.ready.pop(pick % len(own.ready))
        blk = own.blocks[b]
        if blk.written != len(blk.rows):
            raise SealedTooEarly(
                f"rank {o}: block {b} (expert {blk.expert}) computed with {blk.written} of {len(blk.rows)} rows"
            )
        for s, t, k in blk.rows:
            self.partials[(s, t, k)] = expert_output(blk.expert, s, t)
            self.chunk_pending[s][t // self.chunk] -= 1
        blk.computed = True
        for s in range(self.ranks):
            self._combine_ready_chunks(s)

    # --- internals -----------------------------------------------------------------------

    def _ready_if_complete(self, o: int, b: int) -> None:
        blk = self.owners[o].blocks[b]
        if not blk.queued and blk.written == blk.size:
            blk.queued = True
            self.owners[o].ready.append(b)

    def _chunk_copied(self, o: int, s: int, c: int) -> None:
        own = self.owners[o]
        del own.chunk_left[(s, c)]
        own.next_chunk[s] += 1
        slot = c % self.slots
        assert self.slot_chunk[s][slot] == c
        self.slot_readers[s][slot] -= 1  # the source reuses the slot once every owner is done
        if self.seal == SEAL_AFTER_DISPATCH:
            if all(own.next_chunk[r] == self.num_chunks[r] for r in range(self.ranks)):
                self._seal(o)
        elif self.seal == SEAL_AFTER_OWN_CHUNKS and own.next_chunk[o] == self.num_chunks[o]:
            self._seal(o)
        self._combine_ready_chunks(s)

    def _seal(self, o: int) -> None:
        own = self.owners[o]
        if own.sealed:
            return
        own.sealed = True
        for b in own.open_block.values():
            own.blocks[b].size = len(own.blocks[b].rows)
            self._ready_if_complete(o, b)

    def _combine_ready_chunks(self, s: int) -> None:
        while self.combined[s] < self.num_chunks[s]:
            c = self.combined[s]
            # Its rows are all computed, and every owner has taken the chunk (so none is still to come).
            if self.chunk_pending[s][c] or any(own.next_chunk[s] <= c for own in self.owners):
                return
            for t in self._chunk_tokens(s, c):
                row = self.topk_idx[s][t]
                self.y[(s, t)] = combine_token(row, [self.partials.get((s, t, k)) for k in range(len(row))])
            self.combined[s] += 1

    # --- running -------------------------------------------------------------------------

    def actions(self) -> list[tuple[str, int, int]]:
        out: list[tuple[str, int, int]] = []
        for r in range(self.ranks):
            if self.can_publish(r):
                out.append(("publish", r, 0))
            for s in range(self.ranks):
                if self.can_start(r, s):
                    out.append(("start", r, s))
            if self.can_reserve(r):
                out.append(("reserve", r, 0))
            if self.can_write(r):
                out.append(("write", r, 0))
            if self.can_compute(r):
                out.append(("compute", r, 0))
        return out

    def run(self, rng: random.Random, max_steps: int = 1_000_000) -> dict[tuple[int, int], float]:
        """Run to the end under a random interleaving; returns ``y`` per (rank, token). Raises
        when no actor can move before every chunk is combined (a deadlock)."""
        for _ in range(max_steps):
            acts = self.actions()
            if not acts:
                break
            name, r, s = acts[rng.randrange(len(acts))]
            pick = rng.randrange(1 << 30)
            if name == "publish":
                self.publish(r)
            elif name == "start":
                self.start(r, s)
            elif name == "reserve":
                self.reserve(r, pick)
            elif name == "write":
                self.write(r, pick)
            else:
                self.compute(r, pick)
        if self.combined != self.num_chunks:
            raise AssertionError(
                f"stuck: chunks combined {self.combined} of {self.num_chunks}, sealed "
                f"{[o.sealed for o in self.owners]}, ready {[len(o.ready) for o in self.owners]}"
            )
        return self.y


def expert_output(expert: int, source: int, token: int) -> float:
    """A row's partial: depends only on the expert and the token, never on the row's place."""
    return float((expert * 7919 + source * 15485863 + token * 104729) % 1000) / 8.0


def combine_token(experts: Sequence[int], partials: Sequence[float | None]) -> float:
    """The token's output: its slots' partials summed in slot order (dropped slots skipped)."""
    total = 0.0
    for e, p in zip(experts, partials, strict=True):
        if e >= 0:
            assert p is not None, "a routed slot without its partial"
            total += p
    return total


def batch_output(topk_idx: Sequence[Sequence[Sequence[int]]]) -> dict[tuple[int, int], float]:
    """The batch call's output under the same row math."""
    return {
        (s, t): combine_token(row, [expert_output(e, s, t) for e in row])
        for s, rows in enumerate(topk_idx)
        for t, row in enumerate(rows)
    }


def batch_blocks(topk_idx: Sequence[Sequence[Sequence[int]]], experts_per_rank: int, block_rows: int) -> list[int]:
    """Pool blocks of the batch call per owner: each expert's rows from every rank, rounded up
    to whole blocks."""
    ranks = len(topk_idx)
    totals = [0] * (ranks * experts_per_rank)
    for rows in topk_idx:
        for row in rows:
            for e in row:
                if e >= 0:
                    totals[e] += 1
    return [
        sum(ceil_div(n, block_rows) for n in totals[o * experts_per_rank : (o + 1) * experts_per_rank])
        for o in range(ranks)
    ]
