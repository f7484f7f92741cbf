"""Ranks started by ``mpirun``/``mpiexec`` instead of ``megamoe-rt launch``.

:class:`MpiRankContext` offers what the launcher's context offers (rank, world size, the
rank's GPU, broadcast and all-gather of bytes, barrier) over an mpi4py communicator, and carries the
communicator so NVSHMEM bootstraps through MPI rather than through a unique id.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from megamoe_rt.ep.env import SAFE_ENV
from megamoe_rt.ep.group import frame, unframe

_MPI_LIMIT = 1 << 20  # bytes of one rank's all-gather payload
# Set in every rank by the common MPI launchers (Open MPI, MPICH/Hydra and Intel MPI, PMIx).
MPI_ENV_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def under_mpi() -> bool:
    """True in a process an MPI launcher started (checked without initializing MPI)."""
    return any(name in os.environ for name in MPI_ENV_MARKERS)


class MpiRankContext:
    """One rank of ``comm`` (default ``MPI.COMM_WORLD``); its GPU is its rank among the ranks
    on the same node, so a multi-node job maps ranks onto each node's GPUs in order.
    A :class:`megamoe_rt.ep.group.MpiRankGroup`."""

    def __init__(self, comm: Any = None):
        for name, value in SAFE_ENV.items():  # before NVSHMEM or NCCL read them
            os.environ[name] = value
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.mpi_comm = comm
        self.rank = int(comm.Get_rank())
        self.world_size = int(comm.Get_size())
        # The rank among the ranks on this host, in rank order.
        hosts = comm.allgather(socket.gethostname())
        self._local_rank = hosts[: self.rank].count(hosts[self.rank])

    @property
    def device(self) -> int:
        """Its rank on this host, or 0 when the launcher gave each rank one GPU; see
        :func:`megamoe_rt.ep.rendezvous.visible_device`."""
        from megamoe_rt.ep.rendezvous import visible_device

        return visible_device(self._local_rank)

    def broadcast(self, value: bytes | None, *, key: str = "default", root: int = 0) -> bytes:
        """``root`` passes bytes, every rank gets them. ``key`` names the exchange for the
        launcher's context; MPI orders collectives by call order, which ranks share anyway."""
        del key
        if self.rank == root and not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"broadcast: rank {root} must pass bytes, got {type(value).__name__}")
        payload = bytes(value) if self.rank == root and value is not None else None  # checked above on root
        return bytes(self.mpi_comm.bcast(payload, root=root))

    def barrier(self) -> None:
        self.mpi_comm.Barrier()

    def allgather(self, value: bytes, *, key: str = "default") -> list[bytes]:
        """Every rank's bytes in rank order; ``key`` names the exchange, and a rank found in
        another exchange makes every rank raise."""
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"allgather: expected bytes, got {type(value).__name__}")
        frames = self.mpi_comm.allgather(frame(key, bytes(value), _MPI_LIMIT))
        return unframe(key, [bytes(f) for f in frames], f"rank {self.rank}: exchange {key!r}")
