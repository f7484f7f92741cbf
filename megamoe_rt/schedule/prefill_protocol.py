"""Cycle-chunked dispatch (prefill) as a step-level model (CPU only).

When the pool is a ring of ``ring_blocks`` slots smaller than a call's routed blocks, the
dispatch pull runs in ``num_cycles = ceil(total_blocks / ring_blocks)`` rounds, the same count
on every rank (the max of the ranks' counts; a rank with fewer blocks runs empty rounds, so
every rank meets the same barriers). Within a round, pull workers copy rows in pool order,
each worker every ``workers``-th row; a grid barrier closes the round. The GEMM side is not
cut into rounds: it takes blocks in order, each once its rows have landed ("full"), and
releases the slot when done ("empty"); a pull into a slot waits for the slot's previous block
to be released.

A worker finds the source rank of a row from the per-source row counts of the row's expert.
Which expert's counts it holds is state that outlives a round, and that is where a cycle-
chunked pull goes wrong: if the counts are reloaded only when the expert index moves *during
the same loop iteration*, a worker whose scan for its next row crossed into a new expert and
then stopped at the round's bound enters the next round with the new expert's index but the
old expert's counts (the failure seen in practice: counts of zero, a source search that
spins forever). :data:`RELOAD_WHEN_STALE` keeps, with the counts, the expert they belong to
and reloads whenever that differs from the row's expert, which cannot go stale.

:class:`PrefillModel` runs the rounds step by step; tests drive it over random routings,
ring sizes, worker counts and ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megamoe_rt.schedule.plan import num_cycles, num_cycles_across_ranks

RELOAD_WHEN_STALE = "when_stale"  # reload whenever the held counts are not the row's expert's
RELOAD_ON_CHANGE_IN_ITERATION = "on_change_in_iteration"  # the failing policy, kept to show it fails


class StaleCounts(AssertionError):
    """A worker looked up a row's source with another expert's counts."""


class RingOverwrite(AssertionError):
    """A pull wrote a slot whose previous block the GEMM side had not released."""


@dataclass
class Worker:
    next_row: int
    expert: int = 0  # the expert index the row scan is at (kept across rounds)
    counts_of: int = -1  # whose per-source counts the worker holds (-1: none)


@dataclass
class PrefillModel:
    """One receiving rank. ``counts[e][s]``: rows source rank ``s`` sends to local expert ``e``;
    the pool lays them out by expert, then source, each expert padded to ``block_rows``."""

    counts: Sequence[Sequence[int]]
    block_rows: int
    ring_blocks: int
    workers: int
    cycles: int = 0  # 0: this rank's own count (across ranks: the agreed maximum)
    policy: str = RELOAD_WHEN_STALE
    expert_begin: list[int] = field(default_factory=list)  # first pool row of each expert
    expert_rows: list[int] = field(default_factory=list)  # routed rows of each expert
    pulled: list[bool] = field(default_factory=list)  # per pool row
    released: int = 0  # blocks the GEMM side has finished, in order

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.ring_blocks < 1 or self.workers < 1:
            raise ValueError("block_rows, ring_blocks and workers must be positive")
        row = 0
        for per_source in self.counts:
            self.expert_begin.append(row)
            n = sum(per_source)
            self.expert_rows.append(n)
            row += -(-n // self.block_rows) * self.block_rows
        self.expert_begin.append(row)
        self.pulled = [False] * row
        own = num_cycles(self.total_blocks, self.ring_blocks)
        if self.cycles and self.cycles < own:
            raise ValueError(f"cycles={self.cycles}: this rank needs {own}")
        self.cycles = self.cycles or own

    @property
    def total_blocks(self) -> int:
        return self.expert_begin[-1] // self.block_rows

    def _is_routed(self, row: int, expert: int) -> bool:
        return row - self.expert_begin[expert] < self.expert_rows[expert]

    def _source(self, worker: Worker, row: int) -> int:
        """The source rank of ``row`` from the counts the worker holds."""
        if worker.counts_of != worker.expert:
            raise StaleCounts(f"row {row} of expert {worker.expert} looked up with expert {worker.counts_of}'s counts")
        offset = row - self.expert_begin[worker.expert]
        for s, n in enumerate(self.counts[worker.expert]):
            if offset < n:
                return s
            offset -= n
        raise AssertionError("a routed row past its expert's counts")

    def _gemm_release_through(self, block: int) -> None:
        """The GEMM side finishes blocks in order up to ``block`` (each only once it is full)."""
        while self.released <= block:
            b = self.released
            rows = range(b * self.block_rows, (b + 1) * self.block_rows)
            expert = self._expert_of(rows.start)
            if not all(self.pulled[r] for r in rows if self._is_routed(r, expert)):
                return
            self.released += 1

    def _expert_of(self, row: int) -> int:
        e = 0
        while row >= self.expert_begin[e + 1]:
            e += 1
        return e

    def run(self, order: Sequence[int] | None = None) -> list[int]:
        """Every round; ``order`` interleaves the workers (a sequence of worker ids, repeated).
        Returns the source rank of every routed row pulled, in pool order."""
        workers = [Worker(next_row=w) for w in range(self.workers)]
        sources = [-1] * len(self.pulled)
        # Every worker appears in each pass over the order, so every round ends.
        order = [w % self.workers for w in (order or ())] + list(range(self.workers))
        for cycle in range(self.cycles):
            bound = min((cycle + 1) * self.ring_blocks, self.total_blocks) * self.block_rows
            active = set(range(self.workers))
            step = 0
            while active:
                w = order[step % len(order)]
                step += 1
                if w in active and not self._pull_one(workers[w], bound, sources):
                    active.discard(w)
            # The round's grid barrier; the GEMM side drains what has landed.
            self._gemm_release_through(self.total_blocks - 1)
        if not all(self.pulled[r] for e in range(len(self.counts)) for r in self._routed_rows(e)):
            raise AssertionError("a routed row was never pulled")
        return [sources[r] for e in range(len(self.counts)) for r in self._routed_rows(e)]

    def _routed_rows(self, e: int) -> range:
        return range(self.expert_begin[e], self.expert_begin[e] + self.expert_rows[e])

    def _pull_one(self, worker: Worker, bound: int, sources: list[int]) -> bool:
        """The worker's next row of this round; False once it reaches the round's bound."""
        changed = False
        while True:
            row = worker.next_row
            if row >= len(self.pulled):
                return False
            # Scan to the row's expert (this can cross experts before the bound check below).
            while row >= self.expert_begin[worker.expert + 1]:
                worker.expert += 1
                changed = True
            if row >= bound:
                return False  # the next row belongs to a later round
            if self.policy == RELOAD_WHEN_STALE:
                if worker.counts_of != worker.expert:
                    worker.counts_of = worker.expert
            elif self.policy == RELOAD_ON_CHANGE_IN_ITERATION:
                if changed or worker.counts_of < 0:
                    worker.counts_of = worker.expert
            else:
                raise ValueError(f"policy={self.policy!r}")
            worker.next_row += self.workers
            if not self._is_routed(row, worker.expert):
                continue  # padding: nothing to pull
            block = row // self.block_rows
            if block >= self.ring_blocks and self.released <= block - self.ring_blocks:
                # The slot's previous block must be released first; the GEMM side runs
                # concurrently, so let it drain what has landed, then check again.
                self._gemm_release_through(block - self.ring_blocks)
                if self.released <= block - self.ring_blocks:
                    raise RingOverwrite(f"block {block} would overwrite block {block - self.ring_blocks}")
            sources[row] = self._source(worker, row)
            self.pulled[row] = True
            return True


def agreed_cycles(totals: Sequence[int], ring_blocks: int) -> int:
    """The cycle count every rank runs: the max over ranks of ``ceil(total_blocks / ring)``."""
    return num_cycles_across_ranks([num_cycles(t, ring_blocks) for t in totals])
