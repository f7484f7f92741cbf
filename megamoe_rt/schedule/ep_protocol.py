"""The cross-rank protocol of one expert-parallel MoE call, as a step-level model.

Per launch ``n`` every rank uses bank ``n % 2`` of its symmetric workspace and clears bank
``(n + 1) % 2`` for the launch after (launch parity: back-to-back calls need no memset and
no extra barrier). A rank's launch, in order:

1. ``clear``    zero its own other bank;
2. ``publish``  per destination rank: write its send list for that destination into its own
                buffer (not banked: the receiver reads it over NVLink), then write the per-expert
                counts into the destination's bank and release its ``count_ready[me]`` word;
3. ``gather``   wait until every source's ``count_ready`` word is set, acquire the counts of
                every source and lay out the pool;
4. ``pull``     per source: read its send list (peer pointer) and copy the rows;
5. ``scatter``  its L2 tiles are done: set ``combine_ready[me]`` in every source's bank
                (the L2 epilogues wrote the bf16 partials into the sources' combine buffers);
6. ``combine``  wait until every rank's ``combine_ready`` word is set, then reduce.

Every wait is a deadline-bounded acquire on a word of the rank's current bank; every write
into a peer's bank is tagged here with the launch that wrote it, so the model can check that
a reader only ever sees words of its own launch. :class:`EpModel` runs the steps of all ranks
in any interleaving the caller picks; tests drive it with random and adversarial schedules.
``banks=1`` models the protocol without launch parity, which the tests show is unsafe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ProtocolViolation(AssertionError):
    pass


STEPS = ("clear", "publish", "gather", "pull", "scatter", "combine")


@dataclass
class Bank:
    """The words peers write into one rank's bank; payload words carry the launch that wrote them."""

    count_ready: set = field(default_factory=set)  # sources whose count_ready word is set
    combine_ready: set = field(default_factory=set)  # ranks whose combine_ready word is set
    counts: dict = field(default_factory=dict)  # source rank -> launch that wrote them

    def clear(self) -> None:
        self.count_ready.clear()
        self.combine_ready.clear()
        self.counts.clear()


@dataclass
class RankState:
    launch: int = 0
    step: int = 0  # index into STEPS
    progress: int = 0  # per-peer progress inside publish / pull / scatter


class EpModel:
    """``num_ranks`` ranks running ``num_launches`` back-to-back launches."""

    def __init__(
        self,
        num_ranks: int,
        num_launches: int,
        *,
        banks: int = 2,
        clear_other_bank: bool = True,
        withhold: int | None = None,
    ):
        if num_ranks < 1 or num_launches < 1 or banks not in (1, 2):
            raise ValueError(f"num_ranks={num_ranks}, num_launches={num_launches}, banks={banks}")
        self.num_ranks = num_ranks
        self.num_launches = num_launches
        self.banks = banks
        self.clear_other_bank = clear_other_bank
        self.withhold = withhold  # a rank that never signals its peers (a dead or hung rank)
        self.memory = [[Bank() for _ in range(2)] for _ in range(num_ranks)]
        # Not banked: each rank's send list (destination -> launch written, standing in for the
        # x rows published with it) and its combine buffer (source -> launch of its partials).
        self.send_lists: list[dict] = [{} for _ in range(num_ranks)]
        self.combine_buffers: list[dict] = [{} for _ in range(num_ranks)]
        self.ranks = [RankState() for _ in range(num_ranks)]

    # --- helpers ------------------------------------------------------------------------------

    def _bank(self, rank: int, launch: int) -> Bank:
        return self.memory[rank][launch % self.banks]

    def done(self, rank: int) -> bool:
        return self.ranks[rank].launch >= self.num_launches

    def all_done(self) -> bool:
        return all(self.done(r) for r in range(self.num_ranks))

    def enabled(self, rank: int) -> bool:
        """Whether the rank's next step can run now (waits are the only blocking steps)."""
        if self.done(rank):
            return False
        s = self.ranks[rank]
        bank = self._bank(rank, s.launch)
        if STEPS[s.step] == "gather":
            return len(bank.count_ready) == self.num_ranks
        if STEPS[s.step] == "combine":
            return len(bank.combine_ready) == self.num_ranks
        return True

    def _advance(self, s: RankState, per_peer: bool) -> None:
        if per_peer:
            s.progress += 1
            if s.progress < self.num_ranks:
                return
        s.progress = 0
        s.step += 1
        if s.step == len(STEPS):
            s.step = 0
            s.launch += 1

    # --- one step -------------------------------------------------------------------------------

    def step(self, rank: int) -> None:
        """Run the next atomic step of ``rank`` (one store, one signal or one wait)."""
        if not self.enabled(rank):
            raise ValueError(f"rank {rank} cannot step now")
        s = self.ranks[rank]
        n = s.launch
        name = STEPS[s.step]
        own = self._bank(rank, n)
        if name == "clear":
            if self.clear_other_bank:
                if self.banks == 2:
                    self._bank(rank, n + 1).clear()
                elif n > 0:
                    own.clear()  # one bank: it can only be cleared at the start of the launch using it
            self._advance(s, per_peer=False)
        elif name == "publish":
            dest = s.progress
            self.send_lists[rank][dest] = n
            peer = self._bank(dest, n)
            if rank != self.withhold or dest == rank:
                if rank in peer.count_ready:
                    raise ProtocolViolation(f"rank {rank} launch {n}: count_ready of rank {dest} already set")
                peer.counts[rank] = n
                peer.count_ready.add(rank)
            self._advance(s, per_peer=True)
        elif name == "gather":
            for src in range(self.num_ranks):
                seen = own.counts.get(src)
                if seen != n:
                    raise ProtocolViolation(f"rank {rank} launch {n}: counts of rank {src} are from launch {seen}")
            self._advance(s, per_peer=False)
        elif name == "pull":
            src = s.progress
            seen = self.send_lists[src].get(rank)
            if seen != n:
                raise ProtocolViolation(f"rank {rank} launch {n}: send list of rank {src} is from launch {seen}")
            self._advance(s, per_peer=True)
        elif name == "scatter":
            self.combine_buffers[s.progress][rank] = n
            peer = self._bank(s.progress, n)
            if rank in peer.combine_ready:
                raise ProtocolViolation(f"rank {rank} launch {n}: combine_ready of rank {s.progress} already set")
            peer.combine_ready.add(rank)
            self._advance(s, per_peer=True)
        elif name == "combine":
            for src in range(self.num_ranks):
                seen = self.combine_buffers[rank].get(src)
                if seen != n:
                    raise ProtocolViolation(f"rank {rank} launch {n}: partials of rank {src} are from launch {seen}")
            self._advance(s, per_peer=False)

    def run(self, choose) -> None:
        """Step until every rank is done; ``choose(enabled_ranks)`` picks who moves.

        Raises ProtocolViolation on a stale or early read, and on a deadlock (no rank can move).
        """
        while not self.all_done():
            ready = [r for r in range(self.num_ranks) if self.enabled(r)]
            if not ready:
                where = [(r, self.ranks[r].launch, STEPS[self.ranks[r].step]) for r in range(self.num_ranks)]
                raise ProtocolViolation(f"deadlock: no rank can move; (rank, launch, step): {where}")
            self.step(choose(ready))
