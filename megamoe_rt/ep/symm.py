"""NVSHMEM symmetric memory for expert parallelism across ranks (nvshmem4py).

:class:`NvshmemRuntime` bootstraps NVSHMEM in a rank process: rank 0 creates a unique id and
the launcher's local channel (:class:`megamoe_rt.ep.launch.RankContext`) hands it to the others,
so no MPI is needed; under ``mpirun`` (:class:`megamoe_rt.ep.mpi_context.MpiRankContext`) NVSHMEM
bootstraps through MPI instead. :class:`SymmetricBuffer` puts a :class:`BufferLayout` on the symmetric
heap: every rank allocates the same layout, and the base address of each peer's copy (the
nvshmem_ptr of an NVLink peer) lets kernels load from and store into peer regions directly.
NVLink multicast (NVLS) is always disabled.

NVSHMEM's host collectives (init, malloc, free, finalize) cannot be interrupted: a rank that
never enters one leaves its peers inside it for good. So right before each, the ranks meet over
the group's host channel, whose exchanges have deadlines, and say whether each is able to enter
(:func:`megamoe_rt.ep.agreement.enter_together`): all enter, or every rank raises the same error
naming the rank that could not, or the peer that did not come. The on-stream barrier is only
enqueued on the host, so it has no meeting (one would block the host at every call and still not
bound the device-side wait); it is refused when the rank already knows a peer failed.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

from megamoe_rt.ep import agreement
from megamoe_rt.ep.group import RankGroup, check_group, ranks_share_a_gpu
from megamoe_rt.runtime import args, streams
from megamoe_rt.runtime.arrays import require_cupy
from megamoe_rt.runtime.buffer import LaidOutBuffer, typed_view
from megamoe_rt.runtime.errors import INSTALL_HINT
from megamoe_rt.schedule.layout import BufferLayout


def _nvshmem():
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    try:
        import nvshmem.core as nvshmem
    except ImportError as exc:
        raise RuntimeError(f"nvshmem4py is not importable ({exc}); install: {INSTALL_HINT}") from None
    return nvshmem


BOOTSTRAP_ATTEMPTS = 3  # unique-id bootstraps tried before a launch gives up


def peer_address(local_ptr: int, pe: int) -> int:
    """Where rank ``pe``'s copy of the symmetric address ``local_ptr`` lies in this process
    (``nvshmem_ptr``), or 0 when this rank cannot load from or store to it (a peer on another
    node: NVSHMEM's device API reaches it). nvshmem4py's ``get_peer_buffer`` raises for such a
    peer instead, and tracks a Buffer for every address it hands out."""
    from nvshmem.bindings import ptr

    return int(ptr(local_ptr, pe) or 0)


class NvshmemRuntime:
    """NVSHMEM in this process, bound to the rank's GPU; one per process."""

    _active: NvshmemRuntime | None = None

    def __init__(self, ctx: RankGroup, *, heap_bytes: int = 0):
        import numpy as np

        self.rank, self.world_size = check_group(ctx, "ctx")
        self.ctx = ctx
        # Set once an allocation failed on some ranks only: the ranks' heaps are out of step
        # (symmetric addresses would differ), so no rank allocates again.
        self.heap_out_of_step: str | None = None
        failure: Exception | None = None
        nvshmem: Any = None
        dev: Any = None
        try:  # nothing here is collective: every rank learns of a failure before nvshmem_init
            heap_bytes = args.integer("heap_bytes", heap_bytes, minimum=0)
            if heap_bytes and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
                # The default heap (1 GiB) is smaller than a MoE buffer at real shapes; size it for
                # the first buffer with room for a second (the caller's setting wins).
                os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(2 * heap_bytes + (256 << 20))
            nvshmem = _nvshmem()
            from cuda.core import Device

            self.device = ctx.device
            dev = Device(self.device)
            dev.set_current()
        except Exception as exc:  # raised on every rank by the meeting below
            failure = exc
        # Heaps of different sizes would take an allocation on some ranks and refuse it on others.
        heap = {"NVSHMEM_SYMMETRIC_SIZE": os.environ.get("NVSHMEM_SYMMETRIC_SIZE")}
        agreement.enter_together(ctx, "NVSHMEM start-up", failure, same=heap)
        mpi_comm = getattr(ctx, "mpi_comm", None)
        if mpi_comm is not None:  # ranks from mpirun: NVSHMEM's own MPI bootstrap
            nvshmem.init(device=dev, mpi_comm=mpi_comm, initializer_method="mpi")
        else:
            self._init_from_unique_id(nvshmem, dev, np)
        self._nvshmem = nvshmem
        # Ranks on one GPU (MEGAMOE_RT_RANK_DEVICES) run NVSHMEM in its limited multi-process-
        # per-GPU mode, whose on-stream collectives abort the process: barrier() refuses them.
        self.shares_gpu: bool = ranks_share_a_gpu(ctx)
        self._buffers: list[SymmetricBuffer] = []
        self._last_barrier: streams.Event | None = None
        # Loaded libraries handed NVSHMEM's device state (init_device_library), each with what
        # forgets its kernel: finalize() takes the state back before NVSHMEM ends.
        self._device_libraries: list[tuple[Any, Callable[[], None]]] = []

    def _init_from_unique_id(self, nvshmem: Any, dev: Any, np: Any) -> None:
        """NVSHMEM's unique-id bootstrap, retried with a fresh id while it fails on every rank.

        Rank 0 hands out the id through the group; after each attempt the ranks compare
        outcomes: when every rank failed (a stray connection to rank 0's listener, say), all
        retry with a fresh id; when only some did, all raise the same error."""
        failures: list[str] = []
        for _ in range(BOOTSTRAP_ATTEMPTS):
            uid: Any = None
            local: Exception | None = None
            try:
                uid = nvshmem.get_unique_id(empty=self.rank != 0)
                raw = uid._data.view(np.uint8)
            except Exception as exc:  # rank 0 then hands out no id; all raise before nvshmem_init
                local = exc
            if self.rank == 0:
                self.ctx.broadcast(b"" if local else raw.tobytes(), key="nvshmem-uid")
            else:
                data = self.ctx.broadcast(None, key="nvshmem-uid")
                try:
                    if local is None:
                        if not data:
                            raise RuntimeError("rank 0 handed out no unique id (it could not make one)")
                        if len(data) != raw.nbytes:
                            raise RuntimeError(
                                f"rank 0 handed out a unique id of {len(data)} bytes, this rank's NVSHMEM takes "
                                f"{raw.nbytes} (do the ranks' NVSHMEM versions differ?)"
                            )
                        raw[:] = np.frombuffer(data, dtype=np.uint8)
                except Exception as exc:
                    local = exc
            # nvshmem_init waits for every rank: none enters it unless all can.
            agreement.enter_together(self.ctx, "nvshmem_init", local)
            error = ""
            try:
                nvshmem.init(device=dev, uid=uid, rank=self.rank, nranks=self.world_size, initializer_method="uid")
            except Exception as exc:  # reported to every rank below
                error = f"{type(exc).__name__}: {exc}"[:500]
            outcomes = [o.decode() for o in self.ctx.allgather(error.encode(), key="nvshmem-init")]
            bad = [(r, o) for r, o in enumerate(outcomes) if o]
            if not bad:
                return
            failures.append("; ".join(f"rank {r}: {o}" for r, o in bad))
            if len(bad) < self.world_size:
                # Some ranks are in: undoing that (finalize) is itself collective and would
                # wait for the ranks that are not, so no retry; every rank raises alike.
                raise RuntimeError(
                    f"NVSHMEM bootstrap failed on ranks {[r for r, _ in bad]} but not the others; "
                    f"not retried ({failures[-1]})"
                )
        raise RuntimeError(f"NVSHMEM bootstrap failed on all {BOOTSTRAP_ATTEMPTS} attempts: " + " | ".join(failures))

    @classmethod
    def initialize(cls, ctx: RankGroup, *, heap_bytes: int = 0) -> NvshmemRuntime:
        """The process's runtime, created on first use from the launcher context; ``heap_bytes``
        sizes the symmetric heap then (``NVSHMEM_SYMMETRIC_SIZE``, unless already set)."""
        if cls._active is None:
            cls._active = NvshmemRuntime(ctx, heap_bytes=heap_bytes)
        elif (cls._active.rank, cls._active.world_size) != (ctx.rank, ctx.world_size):
            raise RuntimeError(f"NVSHMEM is already initialized as rank {cls._active.rank} of {cls._active.world_size}")
        return cls._active

    def every_peer_mapped(self) -> bool:
        """Whether every rank maps every other rank's symmetric memory (``nvshmem_ptr`` is not
        null: NVLink or PCIe P2P). Collective; every rank gets the same answer."""
        probe = symmetric_malloc(self, 64, "the peer-mapping probe")
        failure: Exception | None = None
        mine = False
        try:
            mine = all(peer_address(int(probe.handle), pe) != 0 for pe in range(self.world_size) if pe != self.rank)
        except Exception as exc:  # every rank raises it at the free below (which no rank then enters)
            failure = exc
        symmetric_free(self, probe, "the peer-mapping probe", failure)
        return all(v == b"1" for v in self.ctx.allgather(b"1" if mine else b"0", key="nvshmem-peers"))

    @classmethod
    def require_device_api(cls, name: str, device: int) -> NvshmemRuntime:
        """The runtime a kernel calling NVSHMEM's device API runs under, or a RuntimeError
        naming the kernel: NVSHMEM must be initialised in this process, on ``device``."""
        rt = cls._active
        if rt is None:
            raise RuntimeError(
                f"kernel {name} calls NVSHMEM's device API: initialise NVSHMEM in this process first "
                "(NvshmemRuntime.initialize, as a layer built with group= does)"
            )
        if rt.device != device:
            raise RuntimeError(
                f"kernel {name} is loaded on GPU {device}, but NVSHMEM runs this process on GPU {rt.device}"
            )
        return rt

    def init_device_library(self, library: Any, name: str, forget: Callable[[], None]) -> None:
        """Hand NVSHMEM's device state to a loaded CUlibrary whose kernels call the device API
        (``nvshmemx_culibrary_init``): once per load, before its first launch. ``forget`` drops
        the loaded kernel (the loader's), called when NVSHMEM ends, so that a later runtime
        loads and initialises it again."""
        from nvshmem import bindings

        status = bindings.culibrary_init(int(library))
        if status:
            raise RuntimeError(f"nvshmemx_culibrary_init failed for kernel {name}: status {status}")
        self._device_libraries.append((library, forget))

    def barrier(self, stream: Any = None) -> None:
        """All ranks reach this point on ``stream`` (any stream :func:`streams.stream_handle`
        accepts; None: CuPy's current stream, else the legacy default stream).

        NVSHMEM runs a team's collectives one at a time, in the same order on every rank; two
        barriers on unordered streams would run at once and deadlock. So outside a graph
        capture each barrier waits on the device for the previous one, whatever its stream.
        In a capture the caller orders them (a captured wait on uncaptured work is refused)."""
        if self.shares_gpu:
            raise RuntimeError(
                "NvshmemRuntime.barrier: ranks share a GPU (MEGAMOE_RT_RANK_DEVICES), where NVSHMEM has no "
                "on-stream barrier; use the rank group's host barrier (ctx.barrier())"
            )
        sh = streams.stream_handle(stream)
        capturing = streams.stream_is_capturing(sh)
        # No host meeting first (as before the host collectives): this barrier is enqueued, not
        # run, here, so a meeting would block the host on its peers at every call and still not
        # bound the barrier itself, which waits on the device when the stream reaches it. What
        # the rank already knows costs nothing to check: a peer the launcher's heartbeats found
        # failed would never arrive, so the barrier is not enqueued for it.
        peer_failure = getattr(self.ctx, "peer_failure", None)
        failure = peer_failure() if callable(peer_failure) else None
        if failure is not None:
            raise RuntimeError(f"NvshmemRuntime.barrier: not entered, a peer failed: {failure}") from failure
        if self._last_barrier is not None and not capturing:
            self._last_barrier.wait_on(sh)
        self._nvshmem.barrier(self._nvshmem.Teams.TEAM_WORLD, stream=streams.core_stream(sh))
        if not capturing:
            if self._last_barrier is None:
                self._last_barrier = streams.Event(device=self.device, timing=False)
            self._last_barrier.record(sh)

    def finalize(self) -> None:
        """Free every symmetric buffer still open, then finalize NVSHMEM (collective: the ranks
        meet first, so a rank that failed or left is raised on every rank, not waited for)."""
        for buf in list(self._buffers):
            buf.close()
        failure: Exception | None = None
        try:
            if self._last_barrier is not None:
                self._last_barrier.close()
                self._last_barrier = None
            if self._device_libraries:
                from nvshmem import bindings

                for library, forget in self._device_libraries:
                    bindings.culibrary_finalize(int(library))
                    forget()  # loaded again (and initialised under the next runtime) if needed later
                self._device_libraries.clear()
        except Exception as exc:  # raised on every rank, none entering nvshmem_finalize
            failure = exc
        meet_before(self, "nvshmem_finalize", failure)
        self._nvshmem.finalize()
        if NvshmemRuntime._active is self:
            NvshmemRuntime._active = None


def _group_of(runtime: Any) -> RankGroup | None:
    """The rank group ``runtime`` runs in; None for a test's stand-in without one (or with only
    an ``allgather``), which meets no one."""
    ctx = getattr(runtime, "ctx", None)
    return ctx if isinstance(ctx, RankGroup) else None


def meet_before(
    runtime: Any, collective: str, failure: BaseException | None = None, same: dict[str, object] | None = None
) -> None:
    """The ranks of ``runtime`` meet on the host right before NVSHMEM host collective
    ``collective`` (:func:`megamoe_rt.ep.agreement.enter_together`, under the group's deadline):
    all enter it, or every rank raises, naming the rank that could not (``failure``: this
    rank's reason) or did not come, or the ``same`` settings that differ. A runtime without a
    group (a test's stand-in) only raises its own ``failure``."""
    ctx = _group_of(runtime)
    if ctx is None:
        if failure is not None:
            raise failure
        return
    agreement.enter_together(ctx, collective, failure, same)


def symmetric_malloc(
    runtime: Any, nbytes: int, what: str, failure: BaseException | None = None, same: dict[str, object] | None = None
) -> Any:
    """``nbytes`` on ``runtime``'s symmetric heap (``nvshmem_malloc``, collective), for ``what``.

    The ranks meet first (``failure``: this rank's reason not to allocate; ``same``: what
    every rank must allocate alike, a ValueError naming what differs otherwise); after the call they
    compare outcomes, so an allocation refused on one rank (heap exhausted) raises on every
    rank, naming it. When some ranks got the memory and others did not, the heaps are out of
    step: the memory is not freed (a free is collective, and the other ranks have nothing to
    free) and no rank allocates again until NVSHMEM is finalized."""
    if failure is None and getattr(runtime, "heap_out_of_step", None):
        failure = RuntimeError(f"the symmetric heap is out of step across ranks: {runtime.heap_out_of_step}")
    meet_before(runtime, f"nvshmem_malloc ({what})", failure, same)
    buf, local = None, None
    try:
        buf = runtime._nvshmem.buffer(nbytes)
    except Exception as exc:  # compared below: the others have returned from the call too
        local = exc
    ctx = _group_of(runtime)
    if ctx is None:
        if local is not None:
            raise local
        return buf
    failed = agreement.gather_failures(ctx, f"after nvshmem_malloc ({what})", local)
    if failed:
        error = agreement.refusal(f"nvshmem_malloc of {nbytes} bytes ({what})", failed)
        if len(failed) < runtime.world_size:
            runtime.heap_out_of_step = f"nvshmem_malloc ({what}) failed on ranks {[r for r, _, _ in failed]} only"
        raise error from local
    return buf


def symmetric_free(runtime: Any, buf: Any, what: str, failure: BaseException | None = None) -> None:
    """Free ``buf`` (``nvshmem_free``, collective) once the ranks have met; a rank that cannot
    (``failure``) or does not come makes every rank raise, no rank freeing (the heaps stay alike)."""
    meet_before(runtime, f"nvshmem_free ({what})", failure)
    runtime._nvshmem.free(buf)


def _layout_shape(layout: BufferLayout) -> dict[str, object]:
    """What every rank's buffer must share (compared before the collective allocation: a rank
    allocating another size would leave the heaps out of step)."""
    names = ("hidden", "intermediate", "num_experts", "num_topk", "num_max_tokens_per_rank", "num_ranks")
    shape: dict[str, object] = {name: getattr(layout, name) for name in names}
    shape.update(
        block_m=layout.block_m,
        pool=layout.pool,
        pool_blocks=layout.pool_blocks,
        act_sf_gran=layout.act_sf_gran,
        total_bytes=layout.total_bytes,
    )
    return {f"layout.{name}": value for name, value in shape.items()}


class SymmetricBuffer(LaidOutBuffer):
    """A :class:`BufferLayout` on the NVSHMEM symmetric heap (same layout on every rank).

    Allocation and :meth:`close` are collective: every rank makes the same calls in order.
    The allocation starts zeroed on every rank before any rank returns from the constructor,
    as the launch-parity banks require (a peer's first signal must not be wiped).
    """

    def __init__(self, layout: BufferLayout, runtime: NvshmemRuntime, *, require_peer_mapping: bool = True):
        self._require_peer_mapping = require_peer_mapping
        self._buf: Any = None
        failure: Exception | None = None
        if layout.num_ranks != runtime.world_size:
            failure = ValueError(f"layout: computed for {layout.num_ranks} ranks, the runtime has {runtime.world_size}")
        self.layout = layout
        self.device: int = runtime.device
        self.rank: int = runtime.rank
        self._runtime = runtime
        self._buf = symmetric_malloc(
            runtime, layout.total_bytes, "the symmetric buffer", failure, same=_layout_shape(layout)
        )
        problem: Exception | None = None
        try:
            self._map_and_zero()
        except Exception as exc:  # every rank must learn of it: the free below is collective
            problem = exc
        # Every rank has zeroed its buffer (or failed) before any rank returns: the launch-
        # parity banks need a peer's first signal not to be wiped.
        text = "" if problem is None else f"{type(problem).__name__}: {problem}"[:1000]
        reports = [r.decode() for r in runtime.ctx.allgather(text.encode(), key="symm-buffer")]
        failed = [(r, t) for r, t in enumerate(reports) if t]
        if failed:
            buf, self._buf = self._buf, None
            symmetric_free(runtime, buf, "a symmetric buffer whose set-up failed")  # no rank leaks it
            lines = "; ".join(f"rank {r}: {t}" for r, t in failed)
            raise RuntimeError(
                f"symmetric buffer: setup failed on rank {failed[0][0]} ({lines}); freed on every rank"
            ) from problem
        runtime._buffers.append(self)

    def _map_and_zero(self) -> None:
        """Every peer's address of the allocation, and this rank's part zeroed."""
        self.base_ptr = int(self._buf.handle)
        self.peer_base_ptrs: list[int] = [
            peer_address(self.base_ptr, pe) if pe != self.rank else self.base_ptr
            for pe in range(self._runtime.world_size)
        ]
        # 0 where a peer is not mapped: kernels reach it through NVSHMEM's device API instead,
        # which only a layer built for that transport may do.
        if self._require_peer_mapping and any(p == 0 for p in self.peer_base_ptrs):
            missing = [pe for pe, p in enumerate(self.peer_base_ptrs) if p == 0]
            raise RuntimeError(f"ranks {missing} are not reachable by load/store (no NVLink peer mapping)")
        cupy = require_cupy()
        with cupy.cuda.Device(self.device):
            self._bytes(0, self.layout.total_bytes).fill(0)
            cupy.cuda.Device(self.device).synchronize()

    def _bytes(self, offset: int, nbytes: int, base: int | None = None) -> Any:
        cupy = require_cupy()
        mem = cupy.cuda.UnownedMemory(
            (self.base_ptr if base is None else base) + offset, nbytes, self, device_id=self.device
        )
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def peer_ptr(self, rank: int, name: str) -> int:
        """Address of region ``name`` in ``rank``'s buffer, usable by this rank's kernels."""
        if not 0 <= rank < len(self.peer_base_ptrs):
            raise ValueError(f"rank={rank}: expected 0..{len(self.peer_base_ptrs) - 1}")
        return self.peer_base_ptrs[rank] + self._locate(name)[1]

    def peer_view(self, rank: int, name: str) -> Any:
        """A CuPy array over region ``name`` of ``rank``'s buffer (NVLink loads and stores)."""
        if not 0 <= rank < len(self.peer_base_ptrs):
            raise ValueError(f"rank={rank}: expected 0..{len(self.peer_base_ptrs) - 1}")
        region, offset = self._locate(name)
        return typed_view(self._bytes(offset, region.nbytes, base=self.peer_base_ptrs[rank]), region)

    def peer_table(self) -> ctypes.Array[ctypes.c_uint64]:
        """Peer base addresses as a ``u64[num_ranks]`` kernel argument."""
        return (ctypes.c_uint64 * len(self.peer_base_ptrs))(*self.peer_base_ptrs)

    def close(self) -> None:
        """Free the symmetric allocation (collective). Waits for this rank's work first: its
        kernels may still read or write the buffers of peers. A rank whose wait fails, or a peer
        that does not come, makes every rank raise and none free (the heaps stay alike); the
        buffer is given up either way."""
        if getattr(self, "_buf", None) is not None:
            failure: Exception | None = None
            try:
                require_cupy().cuda.Device(self.device).synchronize()
            except Exception as exc:  # every rank hears of it before any frees
                failure = exc
            buf, self._buf = self._buf, None
            if self in self._runtime._buffers:
                self._runtime._buffers.remove(self)
            symmetric_free(self._runtime, buf, "a symmetric buffer", failure)
