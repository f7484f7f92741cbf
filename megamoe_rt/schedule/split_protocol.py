"""The split pipeline's protocol between its kernels, as a step-level model (CPU only; the
kernels are the fused kernel's K1/K2 roles and cuda_src/split/split_reduce.cu, driven by
megamoe_rt/modes/split.py; docs/ARCHITECTURE.md, "The split mode").

Three kernels per call, nodes of one CUDA graph: K1 (routing, the pull of routed rows, L1 with
the SwiGLU/requant epilogue) and K2 (L2 with the scatter to combine slots) run concurrently on
disjoint green-context partitions; K3 (the top-k reduce) runs after both. Per pool block one
readiness word, in the buffer:

- K1 writes a block's L1 output tile by tile and, after each tile, adds one to the block's
  word with release semantics;
- K2 takes a block's L2 tasks only once the word (acquired) counts every L1 tile of the
  block; every such wait has a deadline;
- a memset node at the head of the graph zeroes every word on each replay, so a replay
  never finds the previous replay's counts (which already reach the target: K2 would read
  the L1 output before this replay wrote it).

K1 never waits on K2 (with the full pool), so on disjoint partitions both make progress; K3
needs no words on one rank (the graph orders it after both). The kernels add one word the
model leaves out: K1 publishes its routing once (``routing_published``) before any block's
readiness can count, and K2 waits for it before its first block. :class:`SplitModel` executes the protocol one store or load at a
time so tests can drive arbitrary interleavings and replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class ProtocolViolation(AssertionError):
    pass


@dataclass
class SplitModel:
    """``l1_tiles[b]``: the L1 tiles of pool block ``b`` (its N tiles of 2I). K1's tiles are
    dealt round-robin to ``k1_workers`` in block order, K2's blocks to ``k2_workers``.
    ``reset_on_replay``: the graph's memset node (off only to show what it prevents)."""

    l1_tiles: Sequence[int]
    k1_workers: int
    k2_workers: int
    reset_on_replay: bool = True
    replay: int = 0
    ready: list[int] = field(default_factory=list)
    pool: list[list[int]] = field(default_factory=list)  # per block and L1 tile: the replay that wrote it
    partials: list[int] = field(default_factory=list)  # per block: the replay whose L2 wrote it
    _k1_queue: list[list[tuple[int, int]]] = field(default_factory=list)
    _k2_queue: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k1_workers < 1 or self.k2_workers < 1:
            raise ValueError("each kernel needs a partition of at least one worker")
        if any(t < 1 for t in self.l1_tiles):
            raise ValueError("every pool block has at least one L1 tile")
        n = len(self.l1_tiles)
        self.ready = [0] * n
        self.pool = [[0] * t for t in self.l1_tiles]
        self.partials = [0] * n

    # --- a replay of the graph -------------------------------------------------------------

    def start_replay(self) -> None:
        self.replay += 1
        if self.reset_on_replay:
            self.ready = [0] * len(self.l1_tiles)  # the memset node
        tiles = [(b, t) for b, count in enumerate(self.l1_tiles) for t in range(count)]
        self._k1_queue = [tiles[w :: self.k1_workers] for w in range(self.k1_workers)]
        blocks = list(range(len(self.l1_tiles)))
        self._k2_queue = [blocks[w :: self.k2_workers] for w in range(self.k2_workers)]

    def k1_done(self) -> bool:
        return not any(self._k1_queue)

    def k2_done(self) -> bool:
        return not any(self._k2_queue)

    def step_k1(self, worker: int) -> bool:
        """One L1 tile: its output, then the release-add to its block's word. False: nothing left."""
        queue = self._k1_queue[worker]
        if not queue:
            return False
        block, tile = queue.pop(0)
        self.pool[block][tile] = self.replay
        self.ready[block] += 1
        return True

    def can_step_k2(self, worker: int) -> bool:
        queue = self._k2_queue[worker]
        return bool(queue) and self.ready[queue[0]] >= self.l1_tiles[queue[0]]

    def step_k2(self, worker: int) -> bool:
        """One block's L2, once its word counts every L1 tile. False: waiting or nothing left."""
        if not self.can_step_k2(worker):
            return False
        block = self._k2_queue[worker].pop(0)
        stale = [t for t, r in enumerate(self.pool[block]) if r != self.replay]
        if stale:
            raise ProtocolViolation(
                f"replay {self.replay}: K2 read block {block}'s L1 tiles {stale} before this replay wrote them"
            )
        self.partials[block] = self.replay
        return True

    def run_k3(self) -> None:
        """The reduce, after both kernels (a graph dependency): every partial of this replay."""
        if not (self.k1_done() and self.k2_done()):
            raise ProtocolViolation("K3 ran before K1 and K2 finished")
        stale = [b for b, r in enumerate(self.partials) if r != self.replay]
        if stale:
            raise ProtocolViolation(f"replay {self.replay}: K3 read partials of blocks {stale} from another replay")

    def runnable(self) -> list[tuple[str, int]]:
        """Every (kernel, worker) that can take a step now."""
        out = [("k1", w) for w in range(self.k1_workers) if self._k1_queue[w]]
        out += [("k2", w) for w in range(self.k2_workers) if self.can_step_k2(w)]
        return out

    def run_replay(self, choose) -> None:
        """One replay to completion; ``choose(options)`` picks the next step among the runnable
        ones (an arbitrary interleaving). Raises when nothing can run before both kernels are done."""
        self.start_replay()
        while not (self.k1_done() and self.k2_done()):
            options = self.runnable()
            if not options:
                raise ProtocolViolation(f"replay {self.replay}: no kernel can make progress (deadlock)")
            kernel, worker = choose(options)
            (self.step_k1 if kernel == "k1" else self.step_k2)(worker)
        self.run_k3()
