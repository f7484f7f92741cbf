"""A streamed call consumed by the fused persistent kernel (CPU model, one rank): blocks handed to
L1 as chunks fill them, the tickets of a lag order over blocks in the order they complete, and the
progress rules that keep every wait pointed at work that can run. docs/STREAMING.md, "Streaming
into the fused kernel", states the rules; this module checks them step by step.

The actors, each moving one step at a time in an order a random choice decides:

- **Producer** (the router, on SMs of its own). Publishes chunk ``c`` into slot ``c % slots``
  once the slot is free. It needs an SM the consumer does not hold: the consumer's persistent
  blocks each take a whole SM for the whole call, so ``grid <= sms - producer_sms`` is the first
  rule (:class:`ProducerStarved` when broken).
- **Dispatch** (warps of the consumer's blocks that never wait on the GEMMs). Takes published
  chunks in order; each routed pair reserves the next row of its expert's open block (a block
  of ``block_rows`` rows of one expert, opened from a call-wide block counter), then writes it.
  The slot is released once every pair of the chunk is written, never later.
- **Block state** (one word per block). ``written`` and, once the call is sealed, ``size``
  (the block's reserved rows) live in one word, so exactly one atomic operation moves the block
  to complete: the write that fills a full block, the write that brings a sealed partial block to
  its size, or the seal itself when every reserved row was already written. That operation
  appends the block to the ready list; the ready list's order is the order blocks complete.
- **Seal.** Once every chunk is dispatched (every pair reserved), the partial blocks get their
  final size and the total number of blocks is known.
- **GEMM workers** (the consumer's math warpgroups, ``grid`` of them). Each takes the next
  ticket of a launch-wide counter. Tickets follow a lag order over ready-list positions: L1 of
  position ``j`` (``l1_tiles`` tiles), with L2 of position ``j - lag`` after it (``l2_tiles``
  tiles), and the L2 of the last ``lag`` positions after the last L1. A worker holding an L1
  ticket waits until position ``j`` is on the ready list, or exits once the seal says there is
  no position ``j``; an L2 ticket waits until every L1 tile of its position is done.

Progress: an L1 ticket waits only on dispatch and the seal, which wait only on the producer; an
L2 ticket waits only on L1 tickets with smaller numbers, which workers already hold or finished
(tickets are taken in order). So with the producer's SMs free, every wait ends (:meth:`run`
asserts it over random interleavings), and the L1 of full blocks starts before the last chunk
is published when the routing fills blocks early.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from megamoe_rt.schedule.arith import ceil_div
from megamoe_rt.schedule.stream_seal import batch_output, combine_token, expert_output


class ProducerStarved(AssertionError):
    """The consumer's persistent blocks hold every SM: the producer can never run."""


class Stuck(AssertionError):
    """No actor can move before the call is done."""


@dataclass
class _Block:
    expert: int
    rows: list[tuple[int, int]] = field(default_factory=list)  # (token, slot) per reserved row
    written: int = 0
    size: int = 0  # 0 until known: block_rows when full, the reserved rows once sealed
    ready_at: int = -1  # its position on the ready list


def _open_order(num_positions: int, lag: int) -> list[tuple[str, int]]:
    """The lag order before the seal, as far as ``num_positions`` positions: no tail yet."""
    tasks: list[tuple[str, int]] = []
    for j in range(num_positions):
        tasks.append(("l1", j))
        if j - lag >= 0:
            tasks.append(("l2", j - lag))
    return tasks


def lag_order(num_positions: int, lag: int) -> list[tuple[str, int]]:
    """The task order over ready-list positions: ("l1", j) for every j, ("l2", j - lag) after
    ("l1", j), the remaining L2 tasks after the last L1."""
    tasks: list[tuple[str, int]] = []
    for j in range(num_positions):
        tasks.append(("l1", j))
        if j - lag >= 0:
            tasks.append(("l2", j - lag))
    tasks += [("l2", j) for j in range(max(0, num_positions - lag), num_positions)]
    return tasks


def ticket_task(
    ticket: int, lag: int, l1_tiles: int, l2_tiles: int, positions: int | None = None
) -> tuple[str, int, int] | None:
    """Ticket -> (kind, position, tile) in closed form, as the device computes it
    (cuda_src/fused/stream_order.cuh): the open-ended order while ``positions`` is None (before
    the seal), the sealed order over ``positions`` positions otherwise (None past its end).
    Both expand :func:`lag_order` / :func:`_open_order` tile by tile.

    The order is a head of ``lag`` L1 tasks, then periods of L1(j) followed by L2(j - lag); the
    sealed order stops after the period of its last position and closes with the L2 tasks of
    the last ``min(lag, positions)`` positions."""
    period = l1_tiles + l2_tiles
    head_positions = lag if positions is None else min(lag, positions)
    if ticket < head_positions * l1_tiles:
        return "l1", ticket // l1_tiles, ticket % l1_tiles
    if positions is not None and positions <= lag:  # no period: every L1, then every L2
        i, tile = divmod(ticket - positions * l1_tiles, l2_tiles)
        return ("l2", i, tile) if i < positions else None
    u = ticket - lag * l1_tiles
    j = lag + u // period
    if positions is None or j < positions:
        r = u % period
        return ("l1", j, r) if r < l1_tiles else ("l2", j - lag, r - l1_tiles)
    i, tile = divmod(u - (positions - lag) * period, l2_tiles)
    return ("l2", positions - lag + i, tile) if i < lag else None


@dataclass
class FusedStreamModel:
    """``topk_idx[t][k]``: the call's routing (expert ids, -1 dropped) over ``num_experts``
    local experts; ``chunk`` tokens per chunk through ``slots`` ring slots; ``grid`` persistent
    blocks on ``sms`` SMs, the producer needing ``producer_sms`` of them."""

    topk_idx: Sequence[Sequence[int]]
    chunk: int
    slots: int
    block_rows: int
    grid: int
    sms: int
    lag: int = 1
    l1_tiles: int = 2
    l2_tiles: int = 3
    producer_sms: int = 1

    def __post_init__(self) -> None:
        self.num_chunks = ceil_div(len(self.topk_idx), self.chunk)
        self.published = 0
        self.slot_chunk = [-1] * self.slots
        self.slot_busy = [False] * self.slots
        self.dispatched = 0  # chunks whose pairs are all reserved
        self.pending: list[tuple[int, int, int]] = []  # (chunk, token, slot) not yet reserved
        self.in_flight: list[tuple[int, int]] = []  # (chunk, block) reserved, not yet written
        self.chunk_left: dict[int, int] = {}  # rows of a chunk not yet written
        self.blocks: list[_Block] = []
        self.open_block: dict[int, int] = {}
        self.sealed = False
        self.ready: list[int] = []  # block ids in completion order
        self.next_ticket = 0
        self.workers: list[int | None] = [None] * self.grid  # the ticket each holds
        self.ran: set[tuple[str, int, int]] = set()
        self.exited = [False] * self.grid
        self.l1_done: dict[int, int] = {}  # position -> L1 tiles done
        self.l2_done: dict[int, int] = {}
        self.partials: dict[tuple[int, int], float] = {}
        self.first_l1_step = -1
        self.last_publish_step = -1
        # The furthest ready-list position a worker waited on: the open order runs ahead of the
        # call's blocks, past the whole worst-case pool on small calls, so the device's list
        # (sized for that pool) must not be read there (stream/ready_blocks.cuh).
        self.max_position_waited = -1
        self.step = 0
        self._seal_if_dispatched()  # a call of no tokens has no chunk to wait for

    # --- the tickets ---------------------------------------------------------------------

    def _task(self, ticket: int) -> tuple[str, int, int] | None:
        """Ticket -> (kind, position, tile) in the order as far as it is known: the sealed order
        over every position once the seal is in (None past its end), the open-ended order before.
        The two agree on every ticket up to the last L1 and the L2 that follows it; the open-ended
        order's later tickets (L2 of the last ``lag`` positions) move to the sealed order's tail,
        so a worker runs an L2 task of the open-ended order only once the L1 it follows is placed
        (:meth:`_final`)."""
        positions = len(self.blocks) if self.sealed else None
        return ticket_task(ticket, self.lag, self.l1_tiles, self.l2_tiles, positions)

    def _final(self, kind: str, j: int) -> bool:
        """Whether a task read off the open-ended order keeps its ticket in the sealed one: an L1
        task always (its position exists once it is on the ready list), an L2 task once the L1 it
        follows (position j + lag) is on the ready list."""
        return self.sealed or kind == "l1" or j + self.lag < len(self.ready)

    # --- actors --------------------------------------------------------------------------

    def can_publish(self) -> bool:
        if self.sms - self.grid < self.producer_sms:
            return False
        return self.published < self.num_chunks and not self.slot_busy[self.published % self.slots]

    def publish(self) -> None:
        c = self.published
        slot = c % self.slots
        self.slot_chunk[slot], self.slot_busy[slot] = c, True
        self.published += 1
        self.last_publish_step = self.step

    def can_dispatch(self) -> bool:
        return self.dispatched < self.published and not any(p[0] == self.dispatched for p in self.pending)

    def dispatch(self) -> None:
        """Dispatch warps take the next published chunk's pairs (any block's warps may)."""
        c = self.dispatched
        assert self.slot_chunk[c % self.slots] == c, f"slot of chunk {c} reused before it was read"
        tokens = range(c * self.chunk, min(len(self.topk_idx), (c + 1) * self.chunk))
        pairs = [(c, t, k) for t in tokens for k, e in enumerate(self.topk_idx[t]) if e >= 0]
        self.pending += pairs
        self.chunk_left[c] = len(pairs)
        self.dispatched += 1
        if not pairs:
            self._chunk_written(c)
        self._seal_if_dispatched()

    def can_reserve(self) -> bool:
        return bool(self.pending)

    def reserve(self, pick: int) -> None:
        c, t, k = self.pending.pop(pick % len(self.pending))
        e = self.topk_idx[t][k]
        assert not self.sealed, "a row reserved after the seal"
        b = self.open_block.get(e, -1)
        if b < 0 or len(self.blocks[b].rows) == self.block_rows:
            b = len(self.blocks)
            self.blocks.append(_Block(e))
            self.open_block[e] = b
        blk = self.blocks[b]
        blk.rows.append((t, k))
        if len(blk.rows) == self.block_rows:
            self._block_word(b, size=self.block_rows)
        self.in_flight.append((c, b))
        self._seal_if_dispatched()

    def can_write(self) -> bool:
        return bool(self.in_flight)

    def write(self, pick: int) -> None:
        c, b = self.in_flight.pop(pick % len(self.in_flight))
        self._block_word(b, written=1)
        self.chunk_left[c] -= 1
        if self.chunk_left[c] == 0:
            self._chunk_written(c)

    def can_work(self, w: int) -> bool:
        if self.exited[w]:
            return False
        ticket = self.workers[w]
        if ticket is None:
            return True  # taking a ticket never waits
        task = self._task(ticket)
        if task is None:
            return True  # past the sealed order's end: the worker leaves
        kind, j, _ = task
        self.max_position_waited = max(self.max_position_waited, j if kind == "l1" or self.sealed else j + self.lag)
        if not self._final(kind, j):
            return False
        if kind == "l1":
            return j < len(self.ready)
        return self.l1_done.get(j, 0) == self.l1_tiles

    def work(self, w: int) -> None:
        ticket = self.workers[w]
        if ticket is None:
            if self.sealed and self._task(self.next_ticket) is None:
                self.exited[w] = True
                return
            self.workers[w] = self.next_ticket
            self.next_ticket += 1
            return
        task = self._task(ticket)
        self.workers[w] = None
        if task is None:
            self.exited[w] = True
            return
        kind, j, _ = task
        key = (kind, j, task[2])
        assert key not in self.ran, f"{key} ran twice"
        self.ran.add(key)
        if kind == "l1":
            blk = self.blocks[self.ready[j]]
            assert blk.written == blk.size == len(blk.rows), f"L1 read block {self.ready[j]} before its rows landed"
            if self.first_l1_step < 0:
                self.first_l1_step = self.step
            self.l1_done[j] = self.l1_done.get(j, 0) + 1
        else:
            assert self.l1_done.get(j, 0) == self.l1_tiles, f"L2 of position {j} before its L1"
            self.l2_done[j] = self.l2_done.get(j, 0) + 1
            if self.l2_done[j] == self.l2_tiles:
                blk = self.blocks[self.ready[j]]
                for t, k in blk.rows:
                    self.partials[(t, k)] = expert_output(blk.expert, 0, t)

    # --- internals -----------------------------------------------------------------------

    def _block_word(self, b: int, written: int = 0, size: int = 0) -> None:
        """One atomic operation on the block's word; the one that completes it appends it."""
        blk = self.blocks[b]
        was_complete = blk.size > 0 and blk.written == blk.size
        blk.written += written
        if size:
            assert blk.size in (0, size), "a block's size set twice differently"
            blk.size = size
        if not was_complete and blk.size > 0 and blk.written == blk.size:
            assert blk.ready_at < 0, f"block {b} appended twice"
            blk.ready_at = len(self.ready)
            self.ready.append(b)

    def _chunk_written(self, c: int) -> None:
        self.slot_busy[c % self.slots] = False  # released once copied, never after the GEMMs

    def _seal_if_dispatched(self) -> None:
        if self.sealed or self.dispatched < self.num_chunks or self.pending:
            return
        self.sealed = True
        for b in self.open_block.values():
            blk = self.blocks[b]
            if blk.size == 0:
                self._block_word(b, size=len(blk.rows))

    # --- running -------------------------------------------------------------------------

    def done(self) -> bool:
        return all(self.exited)

    def actions(self) -> list[tuple[str, int]]:
        acts: list[tuple[str, int]] = []
        if self.can_publish():
            acts.append(("publish", 0))
        if self.can_dispatch():
            acts.append(("dispatch", 0))
        if self.can_reserve():
            acts.append(("reserve", 0))
        if self.can_write():
            acts.append(("write", 0))
        acts += [("work", w) for w in range(self.grid) if self.can_work(w)]
        return acts

    def run(
        self, rng: random.Random, *, slow_producer: bool = False, max_steps: int = 2_000_000
    ) -> dict[tuple[int, int], float]:
        """Run under a random interleaving; returns the output per (rank 0, token). Raises
        :class:`ProducerStarved` or :class:`Stuck` when no actor can move before the end.
        ``slow_producer``: the producer publishes only when nothing else can move (the
        interleaving where overlap matters most)."""
        while not self.done() and self.step < max_steps:
            acts = self.actions()
            if slow_producer and len(acts) > 1:
                acts = [a for a in acts if a[0] != "publish"]
            if not acts:
                if self.sms - self.grid < self.producer_sms and self.published < self.num_chunks:
                    raise ProducerStarved(
                        f"{self.grid} persistent blocks on {self.sms} SMs leave the producer none; "
                        f"chunks published {self.published} of {self.num_chunks}"
                    )
                raise Stuck(
                    f"published {self.published}/{self.num_chunks}, dispatched {self.dispatched}, sealed "
                    f"{self.sealed}, ready {len(self.ready)}/{len(self.blocks)}, held {self.workers}"
                )
            name, w = acts[rng.randrange(len(acts))]
            pick = rng.randrange(1 << 30)
            if name == "publish":
                self.publish()
            elif name == "dispatch":
                self.dispatch()
            elif name == "reserve":
                self.reserve(pick)
            elif name == "write":
                self.write(pick)
            else:
                self.work(w)
            self.step += 1
        assert self.done(), "the step budget ran out"
        expected = {
            (kind, j, i)
            for kind, j in lag_order(len(self.blocks), self.lag)
            for i in range(self.l1_tiles if kind == "l1" else self.l2_tiles)
        }
        assert self.ran == expected, f"tasks run {len(self.ran)}, expected {len(expected)}"
        return {
            (0, t): combine_token(row, [self.partials.get((t, k)) for k in range(len(row))])
            for t, row in enumerate(self.topk_idx)
        }


def batch_output_one_rank(topk_idx: Sequence[Sequence[int]]) -> dict[tuple[int, int], float]:
    """The batch call's output under the same row math, one rank."""
    return batch_output([topk_idx])
