"""What expert-parallel code needs from the group of ranks it runs in.

Two implementations exist: the launcher's :class:`megamoe_rt.ep.launch.RankContext` (ranks
started by ``megamoe-rt launch`` or ``spawn``) and
:class:`megamoe_rt.ep.mpi_context.MpiRankContext` (ranks started by ``mpirun``). Code that
takes a group annotates it with :class:`RankGroup`, so either (or a test's stand-in) fits.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from megamoe_rt.runtime import args


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


def check_group(group: Any, name: str = "group") -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``, checked before any exchange (a group that cannot be
    one cannot agree on anything): a TypeError for an object that is not a :class:`RankGroup`
    or a rank or world size that is not an int (a bool is not), a ValueError for a world size
    below 1 or a rank outside ``[0, world_size)``; each names the attribute and its value."""
    if not isinstance(group, RankGroup):
        raise TypeError(
            f"{name}: expected a RankGroup (megamoe_rt.ep.launch.context_from_env(), an MpiRankContext, or any "
            f"object with rank, world_size, device, broadcast, barrier and allgather), got {type(group).__name__}"
        )
    world = args.integer(f"{name}.world_size", group.world_size, minimum=1)
    rank = args.integer(f"{name}.rank", group.rank)
    if not 0 <= rank < world:
        raise ValueError(f"{name}.rank={rank}: expected 0 <= rank < {name}.world_size={world}")
    return rank, world


_NO_UUID = b"\0no uuid: "  # a GPU's UUID is printable text, so this cannot be one


def ranks_share_a_gpu(group: RankGroup) -> bool:
    """Whether two ranks of ``group`` run on one GPU (``MEGAMOE_RT_RANK_DEVICES``, see
    docs/ARCHITECTURE.md, "Launchers"): their kernels then take turns on it. Collective: a rank
    that cannot name its GPU makes every rank raise, naming it."""
    try:
        from cuda.core import Device

        mine = str(Device(group.device).uuid).encode()
    except Exception as exc:  # every rank must hear of it: the others are in the exchange
        mine = _NO_UUID + f"{type(exc).__name__}: {exc}"[:1000].encode()
    uuids = group.allgather(mine, key="gpu-uuids")
    failed = [(r, u[len(_NO_UUID) :].decode(errors="replace")) for r, u in enumerate(uuids) if u.startswith(_NO_UUID)]
    if failed:
        lines = "; ".join(f"rank {r}: {text}" for r, text in failed)
        raise RuntimeError(f"GPU identity: rank {failed[0][0]} could not read its GPU's UUID ({lines})")
    return len(set(uuids)) < group.world_size


# --- framing of all-gather payloads ------------------------------------------------------------
# Each payload travels as ``key NUL kind data``: a rank whose collective calls got out of step
# with the others (one rank calling check() alone, say) is found at the next exchange instead
# of having its payload read as something else, and a payload too large to travel is replaced
# by a note, so every rank raises instead of one rank raising before it posted.

_VALUE, _TOO_LARGE = b"v", b"x"


def frame(key: str, value: bytes, limit: int) -> bytes:
    """``value`` framed for exchange ``key``, or a note of its size when the frame would
    exceed ``limit`` bytes."""
    head = key.encode() + b"\0"
    if len(head) + 1 + len(value) <= limit:
        return head + _VALUE + value
    return head + _TOO_LARGE + str(len(value)).encode()


def unframe(key: str, frames: list[bytes], who: str) -> list[bytes]:
    """The values of every rank's frame of exchange ``key``; raises the same error on every
    rank when a rank was in another exchange or had too much to say."""
    out = []
    for r, raw in enumerate(frames):
        got, _, rest = raw.partition(b"\0")
        if got != key.encode():
            raise RuntimeError(
                f"{who}: exchange {key!r} met rank {r}'s exchange {got.decode(errors='replace')!r}: "
                "the ranks' collective calls are out of step"
            )
        if rest[:1] == _TOO_LARGE:
            raise ValueError(f"{who}: exchange {key!r}: rank {r} passed {rest[1:].decode()} bytes, more than fits")
        out.append(rest[1:])
    return out
