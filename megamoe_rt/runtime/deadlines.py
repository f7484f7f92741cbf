"""Deadlines of device-side spin-waits (cuda_src/sync/deadline_wait.cuh)."""

from __future__ import annotations

import ctypes
import math
import os

from megamoe_rt.kernels.interface import sync as decl
from megamoe_rt.kernels.interface.structs import TimeoutRecord as _RecordFields  # as it lies in host memory
from megamoe_rt.kernels.interface.structs import WaitContext as WaitContext
from megamoe_rt.runtime import driver

DEFAULT_TIMEOUT_S = 60.0
ENV = "MEGAMOE_RT_TIMEOUT_S"
# Deadlines are clamped to [1 ms, 2^58 ns]: below a millisecond a healthy wait would already
# trap, and waits that can only be stuck behind another one scale the deadline by up to 2^5,
# which must stay inside the device's 64-bit nanosecond arithmetic.
MIN_TIMEOUT_NS = 1_000_000
MAX_TIMEOUT_NS = 1 << 58


def env_seconds(name: str, default: float) -> float:
    """A duration in seconds from the environment variable ``name`` (unset or empty: ``default``);
    anything but a positive, finite number is a ValueError naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r}: expected a positive, finite number of seconds")
    return value


def wait_timeout_ns(timeout_s: float | None = None) -> int:
    """The deadline every cross-rank or cross-block wait of a launch gets, in nanoseconds.

    ``timeout_s`` wins; else ``$MEGAMOE_RT_TIMEOUT_S``; else 60 s. Non-finite, zero or negative
    values are refused; the rest is clamped to ``[MIN_TIMEOUT_NS, MAX_TIMEOUT_NS]``.
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))):
        raise TypeError(f"timeout_s: expected a number of seconds or None, got {type(timeout_s).__name__}")
    if timeout_s is None:
        timeout_s = env_seconds(ENV, DEFAULT_TIMEOUT_S)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    return max(MIN_TIMEOUT_NS, min(MAX_TIMEOUT_NS, int(min(timeout_s, MAX_TIMEOUT_NS * 1e-9) * 1e9)))


# --- timeout records ------------------------------------------------------------------------

# WaitSite messages, in enum order: the same list the device's wait_site_name() returns from.
WAIT_SITES = decl.WAIT_SITE.messages


class TimeoutRecord:
    """Mapped pinned host memory a timed-out wait writes before it traps.

    The host can still read it after the trap has poisoned the context, which is how
    kernels that cannot printf (wgmma kernels) name the wait that failed. One per process.
    """

    _instance: TimeoutRecord | None = None

    def __init__(self) -> None:
        cu = driver.cuda_driver()
        driver.ensure_context()
        size = ctypes.sizeof(_RecordFields)
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.host_ptr = int(driver.call(cu.cuMemHostAlloc, size, flags))
        ctypes.memset(self.host_ptr, 0, size)
        self.device_ptr = int(driver.call(cu.cuMemHostGetDevicePointer, self.host_ptr, 0))
        self._fields = _RecordFields.from_address(self.host_ptr)

    @classmethod
    def get(cls) -> TimeoutRecord:
        if cls._instance is None:
            cls._instance = TimeoutRecord()
            driver.register_fault_explainer(cls.pending_message)
        return cls._instance

    _reported: str | None = None

    @classmethod
    def pending_message(cls) -> str | None:
        """The message of a recorded timeout, or None (also when no record was ever made).

        A complete record is reported once and then reset, so the next timed-out wait records
        afresh instead of finding the slot taken; the message stays the answer for the faults
        the same trap keeps causing (a trapped context fails every later call) until
        :meth:`forget`."""
        inst = cls._instance
        if inst is None:
            return None
        if inst._fields.state == decl.RECORD_COMPLETE.value:
            cls._reported = describe(inst._fields)
            ctypes.memset(ctypes.addressof(inst._fields), 0, ctypes.sizeof(_RecordFields))
        return cls._reported

    @classmethod
    def forget(cls) -> None:
        """Drop the reported message (after the context that trapped has been replaced)."""
        cls._reported = None

    def context(self, timeout_s: float | None = None, rank: int = 0) -> WaitContext:
        return WaitContext(timeout_ns=wait_timeout_ns(timeout_s), record=self.device_ptr, rank=rank)


_RING_OVERFLOW = decl.WAIT_SITE["kRingOverflow"]
# Block-local waits on shared-memory mbarriers (sync/mbarrier_deadline.cuh): peer is the stage
# or queue slot, expected the phase parity.
_MBARRIER_SITES = {decl.WAIT_SITE[n] for n in ("kSmemStageFull", "kSmemStageFree", "kTileTicket", "kRelayPost")}
_GRID_BARRIER = decl.WAIT_SITE["kGridBarrier"]
_STREAM_BLOCK_READY = decl.WAIT_SITE["kStreamBlockReady"]
# What a timed-out ring wait never saw, by site: a producer may publish the two halves of a
# chunk from different kernels, so the report says which half is missing.
_STREAM_SITES = {
    decl.WAIT_SITE["kStreamRouteReady"]: ("published", "; the routing half (topk_idx / topk_weights) is missing"),
    decl.WAIT_SITE["kStreamLayoutReady"]: ("published", "; the activation half (x / x_sf) is missing"),
    decl.WAIT_SITE["kStreamSlotFree"]: ("consumed", ""),
}


def _generation(gen: int) -> str:
    """A ring generation (epoch << 32 | chunk + 1) in words."""
    epoch, seq = gen >> 32, gen & 0xFFFFFFFF
    return f"call {epoch} chunk {seq - 1}" if seq else f"call {epoch}, no chunk"


def describe(rec: _RecordFields) -> str:
    if rec.site in _STREAM_SITES:
        site = WAIT_SITES[rec.site]
        never, missing = _STREAM_SITES[rec.site]
        return (
            f"megamoe_rt: wait '{site}' timed out after {rec.elapsed_ns * 1e-9:.2f} s on rank {rec.rank}: "
            f"input ring slot {rec.peer} was never {never} for generation "
            f"{rec.expected:#x} ({_generation(rec.expected)}); it holds {rec.seen:#x}{missing}"
        )
    if rec.site == _RING_OVERFLOW:
        return (
            f"megamoe_rt: a single-wave call needs {rec.seen} pool blocks but the ring holds {rec.expected} "
            f"(block {rec.block}, rank {rec.rank}); num_tokens_bound must cover every rank's token count"
        )
    if rec.site == _GRID_BARRIER:
        return (
            f"megamoe_rt: wait 'grid barrier' timed out after {rec.elapsed_ns * 1e-9:.2f} s on rank {rec.rank}: "
            f"block {rec.block} arrived as {rec.peer} of {rec.expected} blocks and the barrier never opened "
            f"(generation {rec.seen}): a block of this launch is stuck in an earlier wait or never ran"
        )
    if rec.site == _STREAM_BLOCK_READY:
        return (
            f"megamoe_rt: wait 'stream block ready' timed out after {rec.elapsed_ns * 1e-9:.2f} s on rank {rec.rank}: "
            f"ready-list position {rec.peer} never filled ({rec.seen} blocks had completed) and the call was "
            "not sealed: a chunk was never published, or rows reserved in a block were never written"
        )
    site = WAIT_SITES[rec.site] if rec.site < len(WAIT_SITES) else f"site {rec.site}"
    if rec.site in _MBARRIER_SITES:
        return (
            f"megamoe_rt: wait '{site}' timed out after {rec.elapsed_ns * 1e-9:.1f} s: block {rec.block} "
            f"thread {rec.thread}, rank {rec.rank}: phase {rec.expected} of slot {rec.peer} never completed "
            "(a wait inside the block: its TMA loads or another of its warps stalled)"
        )
    return (
        f"megamoe_rt: wait '{site}' timed out after {rec.elapsed_ns * 1e-9:.2f} s: block {rec.block} "
        f"thread {rec.thread}, rank {rec.rank}, peer {rec.peer}, expected >= {rec.expected}, saw {rec.seen}"
    )
