"""What expert-parallel code needs from the group of ranks it runs in.

Two implementations exist: the launcher's :class:`megamoe_rt.ep.launch.RankContext` (ranks
started by ``megamoe-rt launch`` or ``spawn``) and
:class:`megamoe_rt.ep.mpi_context.MpiRankContext` (ranks started by ``mpirun``). Code that
takes a group annotates it with :class:`RankGroup`, so either (or a test's stand-in) fits.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RankGroup(Protocol):
    """One rank's view of its group: who it is, its GPU, and three collectives on bytes.

    Every rank calls :meth:`broadcast` and :meth:`barrier` the same number of times in the
    same order (they are collectives).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> int:
        """This rank's GPU ordinal."""
        ...

    def broadcast(self, value: bytes | None, *, key: str = "default", root: int = 0) -> bytes:
        """``root`` passes bytes, every rank returns them; ``key`` names the exchange."""
        ...

    def barrier(self) -> None: ...

    def allgather(self, value: bytes, *, key: str = "default") -> list[bytes]:
        """Every rank passes bytes, every rank returns all of them in rank order. Called on
        every layer call across ranks, so it must be cheap (microseconds, not a round trip
        through a server)."""
        ...


@runtime_checkable
class MpiRankGroup(RankGroup, Protocol):
    """A group that also carries an mpi4py communicator (NVSHMEM then bootstraps over MPI)."""

    @property
    def mpi_comm(self) -> Any: ...
