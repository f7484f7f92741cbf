"""A streamed call with one call-wide pool: reservations and a seal (CPU model).

Today a streamed call runs every chunk as a call of its own (chunk-local pools), so every
chunk reads every local expert's weights again (bench/results/stream_h200_2026-12-01.md). This
models the consumer that reads them once per call, as the batch call does:

- **Reserve.** As chunk ``c`` is published, dispatch workers take its routed pairs. A pair
  of expert ``e`` reserves the next row of ``e``'s open pool block (``fill[e]``); the worker
  that fills a block's last row opens the next one from a call-wide block counter. A pool
  block therefore holds rows of one expert, as a grouped-GEMM m-block needs.
- **Write, then count.** The worker copies the row into the block, then adds to the block's
  ``written`` count (release). The block is ready once ``written`` reaches its size: the
  block size while the expert can still grow, its ``reserved`` rows once the call is sealed.
- **Release the input early.** A chunk's ring slot is released when all its rows are copied
  into the pool, not when they are computed: producers never wait on the GEMMs.
- **Seal.** When every chunk of the call is dispatched, each expert's open partial block gets
  its final size. Sealing earlier (for example when the last chunk is published) can hand a
  block to the GEMMs with rows still being written: :class:`SealedTooEarly` shows it.
- **Compute, combine.** GEMM workers take ready blocks in any order. Each computed row
  decrements its chunk's pending count, and a chunk is combined once its count reaches zero
  (partials summed in slot order, as in the batch call).

The blocks used per expert are ``ceil(total_e / block_rows)``, exactly the batch pool's, and a
row's math does not depend on where it lands, so the output is the batch call's, bit for bit.
:class:`SealModel` runs this step by step under a scheduler that picks the next actor;
tests drive it over random routings, chunkings and interleavings.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from megamoe_rt.schedule.arith import ceil_div

SEAL_AFTER_DISPATCH = "after_dispatch"  # the seal waits until every chunk is dispatched
SEAL_AFTER_PUBLISH = "after_publish"  # the failing policy: seal once the last chunk is published


class SealedTooEarly(AssertionError):
    """A block was handed to the GEMMs before all its reserved rows were written."""


class SlotOverwrite(AssertionError):
    """A producer overwrote an input slot whose rows had not all been copied."""


@dataclass
class Block:
    expert: int
    rows: list[tuple[int, int]] = field(default_factory=list)  # (token, slot) per reserved row
    written: int = 0
    size: int = 0  # rows that make it ready: block_rows, or the reserved rows once sealed
    queued: bool = False
    computed: bool = False


@dataclass
class SealModel:
    """One rank, ``topk_idx[t][k]`` local expert ids (-1: dropped); ``chunk`` tokens per
    chunk through ``slots`` input slots; ``workers`` dispatch workers, ``seal`` a policy."""

    topk_idx: Sequence[Sequence[int]]
    num_experts: int
    chunk: int
    slots: int
    block_rows: int
    workers: int = 2
    seal: str = SEAL_AFTER_DISPATCH

    def __post_init__(self) -> None:
        t = len(self.topk_idx)
        self.num_chunks = ceil_div(t, self.chunk) if t else 0
        self.published = 0  # chunks the producer has written into their slots
        self.slot_chunk = [-1] * self.slots  # the chunk each slot holds
        self.slot_copied = [True] * self.slots  # every row of the slot's chunk is in the pool
        # Dispatch: per chunk, its pairs split among the workers (pair i to worker i % workers).
        self.pending_pairs: list[list[tuple[int, int]]] = [[] for _ in range(self.workers)]
        self.dispatch_chunk = 0  # the chunk the workers are dispatching (in order)
        self.chunk_pairs_left = 0
        self.dispatched = 0  # chunks whose rows are all in the pool
        self.sealed = False
        self.publish_sealed_at = -1
        self.blocks: list[Block] = []
        self.open_block = [-1] * self.num_experts
        self.in_flight: list[tuple[int, int, int]] = []  # (worker, block, row) reserved, not written
        self.ready: list[int] = []
        self.chunk_pending = [0] * self.num_chunks  # routed rows of the chunk not yet computed
        self.combined: list[int] = []
        self.partials: dict[tuple[int, int], float] = {}
        self.y: dict[int, float] = {}

    # --- the actors ----------------------------------------------------------------------

    def can_publish(self) -> bool:
        if self.published >= self.num_chunks:
            return False
        return self.slot_copied[self.published % self.slots]

    def publish(self) -> None:
        s = self.published % self.slots
        if not self.slot_copied[s]:
            raise SlotOverwrite(f"chunk {self.published} into slot {s} before chunk {self.slot_chunk[s]} was copied")
        self.slot_chunk[s], self.slot_copied[s] = self.published, False
        self.published += 1
        if self.seal == SEAL_AFTER_PUBLISH and self.published == self.num_chunks:
            self._seal()

    def can_start_chunk(self) -> bool:
        idle = self.chunk_pairs_left == 0 and not self.in_flight
        return idle and self.dispatch_chunk < self.published

    def start_chunk(self) -> None:
        c = self.dispatch_chunk
        pairs = [
            (t, k)
            for t in range(c * self.chunk, min(len(self.topk_idx), (c + 1) * self.chunk))
            for k in range(len(self.topk_idx[t]))
            if self.topk_idx[t][k] >= 0
        ]
        for i, pair in enumerate(pairs):
            self.pending_pairs[i % self.workers].append(pair)
        self.chunk_pairs_left = len(pairs)
        self.chunk_pending[c] = len(pairs)
        if not pairs:
            self._chunk_dispatched()

    def can_reserve(self, w: int) -> bool:
        return bool(self.pending_pairs[w])

    def reserve(self, w: int) -> None:
        """Worker ``w`` claims a row for its next pair (an atomic add on the expert's fill)."""
        t, k = self.pending_pairs[w].pop(0)
        e = self.topk_idx[t][k]
        if self.sealed:
            raise SealedTooEarly(f"token {t} reserved a row of expert {e} after the call was sealed")
        b = self.open_block[e]
        if b < 0 or len(self.blocks[b].rows) == self.block_rows:
            b = len(self.blocks)
            self.blocks.append(Block(e, size=self.block_rows))
            self.open_block[e] = b
        self.blocks[b].rows.append((t, k))
        self.in_flight.append((w, b, len(self.blocks[b].rows) - 1))

    def can_write(self, w: int) -> bool:
        return any(f[0] == w for f in self.in_flight)

    def write(self, w: int) -> None:
        """Worker ``w`` copies its oldest reserved row into the pool, then counts it (release)."""
        i = next(i for i, f in enumerate(self.in_flight) if f[0] == w)
        _, b, _ = self.in_flight.pop(i)
        blk = self.blocks[b]
        blk.written += 1
        self._ready_if_complete(b)
        self.chunk_pairs_left -= 1
        if self.chunk_pairs_left == 0 and not self.in_flight:
            self._chunk_dispatched()

    def can_compute(self) -> bool:
        return bool(self.ready)

    def compute(self, pick: int) -> None:
        """A GEMM worker takes a ready block (any of them) and runs L1 and L2 over its rows."""
        b = self.ready.pop(pick % len(self.ready))
        blk = self.blocks[b]
        if blk.written != len(blk.rows):
            raise SealedTooEarly(f"block {b} (expert {blk.expert}) computed with {blk.written} of {len(blk.rows)} rows")
        for t, k in blk.rows:
            self.partials[(t, k)] = expert_output(blk.expert, t)
            self.chunk_pending[t // self.chunk] -= 1
        blk.computed = True
        self._combine_ready_chunks()

    # --- internals -----------------------------------------------------------------------

    def _ready_if_complete(self, b: int) -> None:
        blk = self.blocks[b]
        if not blk.queued and blk.written == blk.size:
            blk.queued = True
            self.ready.append(b)

    def _chunk_dispatched(self) -> None:
        c = self.dispatch_chunk
        s = c % self.slots
        assert self.slot_chunk[s] == c
        self.slot_copied[s] = True  # the slot's rows are all in the pool: release it
        self.dispatch_chunk += 1
        self.dispatched += 1
        if self.dispatched == self.num_chunks and self.seal == SEAL_AFTER_DISPATCH:
            self._seal()
        self._combine_ready_chunks()

    def _seal(self) -> None:
        self.sealed = True
        for b in self.open_block:
            if b >= 0:
                self.blocks[b].size = len(self.blocks[b].rows)
                self._ready_if_complete(b)

    def _combine_ready_chunks(self) -> None:
        for c in range(len(self.combined), self.dispatched):
            if self.chunk_pending[c]:
                return
            for t in range(c * self.chunk, min(len(self.topk_idx), (c + 1) * self.chunk)):
                self.y[t] = combine_token(
                    self.topk_idx[t], [self.partials.get((t, k)) for k in range(len(self.topk_idx[t]))]
                )
            self.combined.append(c)

    # --- running -------------------------------------------------------------------------

    def actions(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        if self.can_publish():
            out.append(("publish", 0))
        if self.can_start_chunk():
            out.append(("start", 0))
        for w in range(self.workers):
            if self.can_reserve(w):
                out.append(("reserve", w))
            if self.can_write(w):
                out.append(("write", w))
        if self.can_compute():
            out.append(("compute", 0))
        return out

    def run(self, rng: random.Random, max_steps: int = 1_000_000) -> dict[int, float]:
        """Run to the end under a random interleaving; returns ``y`` per token. Raises if no
        actor can move before the call is complete (a deadlock)."""
        for _ in range(max_steps):
            acts = self.actions()
            if not acts:
                break
            name, arg = acts[rng.randrange(len(acts))]
            if name == "publish":
                self.publish()
            elif name == "start":
                self.start_chunk()
            elif name == "reserve":
                self.reserve(arg)
            elif name == "write":
                self.write(arg)
            else:
                self.compute(rng.randrange(1 << 30))
        if len(self.combined) != self.num_chunks:
            raise AssertionError(
                f"stuck: {len(self.combined)} of {self.num_chunks} chunks combined, {self.dispatched} dispatched, "
                f"{len(self.ready)} blocks ready, sealed={self.sealed}"
            )
        return self.y


def expert_output(expert: int, token: int) -> float:
    """A row's partial: depends only on the expert and the token, never on the row's place."""
    return float((expert * 7919 + token * 104729) % 1000) / 8.0


def combine_token(experts: Sequence[int], partials: Sequence[float | None]) -> float:
    """The token's output: its slots' partials summed in slot order (dropped slots skipped)."""
    total = 0.0
    for e, p in zip(experts, partials, strict=True):
        if e >= 0:
            assert p is not None, "a routed slot without its partial"
            total += p
    return total


def batch_output(topk_idx: Sequence[Sequence[int]]) -> dict[int, float]:
    """The batch call's output under the same row math."""
    return {t: combine_token(row, [expert_output(e, t) for e in row]) for t, row in enumerate(topk_idx)}


def batch_blocks(topk_idx: Sequence[Sequence[int]], num_experts: int, block_rows: int) -> int:
    """Pool blocks of the batch call: each expert's rows rounded up to whole blocks."""
    totals = [0] * num_experts
    for row in topk_idx:
        for e in row:
            if e >= 0:
                totals[e] += 1
    return sum(ceil_div(n, block_rows) for n in totals)
