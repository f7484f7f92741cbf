"""Owned CUDA streams and events (cuda.core's underneath), stream-ordered copies and fills,
and what decides whether two streams order their work (:class:`StreamOrder`)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from megamoe_rt.runtime import driver


def _protocol_handle(stream: Any, proto: Any) -> int:
    """The handle from a ``__cuda_stream__`` protocol: a method returning ``(version, handle)``
    (cuda.core, CuPy, PyTorch, cuda.bindings' CUstream), or the same tuple as an attribute
    (early cuda.core)."""
    value = proto() if callable(proto) else proto
    try:
        version, handle = value
    except (TypeError, ValueError):
        raise TypeError(
            f"stream: {type(stream).__name__}.__cuda_stream__ gave {value!r}, expected (version, handle)"
        ) from None
    if int(version) != 0:
        raise TypeError(
            f"stream: {type(stream).__name__}.__cuda_stream__ speaks protocol version {version}; "
            "megamoe_rt understands version 0"
        )
    return int(handle)


def stream_handle(stream: Any = None) -> int:
    """A raw CUstream handle (int) from what users pass as ``stream``.

    None means CuPy's current stream when CuPy is loaded, else the legacy default stream
    (0). Accepted: ints (a raw handle), :class:`Stream`, any object with the
    ``__cuda_stream__`` protocol (cuda.core streams, CuPy and PyTorch streams where they
    have it, cuda.bindings ``CUstream``), PyTorch streams by ``.cuda_stream``
    (``torch.cuda.Stream``, ``torch.cuda.ExternalStream``) and CuPy streams by ``.ptr``.
    Launches call this for every kernel, so a plain int returns at once.
    """
    if type(stream) is int:
        if stream < 0:
            raise ValueError(f"stream: a handle is a non-negative int, got {stream}")
        return stream
    if stream is None:
        import sys

        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, Stream):  # the common case, before the protocol's lookup
        return stream.handle
    if isinstance(stream, (bool, float, str, bytes, np.bool_, np.floating)):  # int() would take them
        raise TypeError(f"stream: expected a stream or an int handle, got {type(stream).__name__} {stream!r}")
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return _protocol_handle(stream, proto)
    torch_handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream / ExternalStream
    if torch_handle is not None:
        return int(torch_handle)
    ptr = getattr(stream, "ptr", None)  # CuPy streams without the protocol
    if ptr is not None:
        return int(ptr)
    try:
        handle = int(stream)  # numpy integers, CUstream of older bindings
    except (TypeError, ValueError):
        raise TypeError(
            "stream: expected None, an int handle, a cuda.core / CuPy / PyTorch stream or an object with "
            f"__cuda_stream__, got {type(stream).__name__}"
        ) from None
    if handle < 0:
        raise ValueError(f"stream: a handle is a non-negative int, got {handle}")
    return handle


def core_stream(stream: Any = None) -> Any:
    """``stream`` as a ``cuda.core.Stream``, for APIs that take one (nvshmem4py, cuda.core).

    A cuda.core stream is returned as is; anything else :func:`stream_handle` accepts is
    wrapped without taking ownership (the caller keeps the stream alive). The legacy and
    per-thread default streams map to cuda.core's own objects for them.
    """
    core = driver.cuda_core()
    if isinstance(stream, core.Stream):
        return stream
    if isinstance(stream, Stream):
        return stream.core
    handle = stream_handle(stream)
    if handle in (0, 1):  # 0 and CU_STREAM_LEGACY both name the legacy default stream
        return core.LEGACY_DEFAULT_STREAM
    if handle == 2:  # CU_STREAM_PER_THREAD
        return core.PER_THREAD_DEFAULT_STREAM
    return driver.core_call("cuStreamGetCtx", core.Stream.from_handle, handle)


def stream_is_capturing(stream: Any = None) -> bool:
    cu = driver.cuda_driver()
    status = driver.call(cu.cuStreamIsCapturing, stream_handle(stream))
    return bool(status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


class Stream:
    """An owned CUDA stream on a device's primary context (a ``cuda.core.Stream``
    underneath, as :attr:`core`); destroyed by :meth:`close` or when it goes away."""

    def __init__(self, *, non_blocking: bool = True, priority: int | None = None, device: int | None = None):
        core = driver.cuda_core()
        dev = driver.core_device(device)
        self.device = int(dev.device_id)
        options = core.StreamOptions(nonblocking=non_blocking, priority=priority)
        self._stream = driver.core_call("cuStreamCreateWithPriority", dev.create_stream, options=options)
        # The int is what every launch asks for: read it once.
        self._handle: int | None = int(self._stream.handle)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError("stream: this Stream is closed")
        return self._handle

    @property
    def core(self) -> Any:
        """The ``cuda.core.Stream`` (for cuda.core APIs)."""
        if self._handle is None:
            raise ValueError("stream: this Stream is closed")
        return self._stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def synchronize(self) -> None:
        driver.core_call("cuStreamSynchronize", self.core.sync)

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self._handle = None
            driver.core_call("cuStreamDestroy", self._stream.close)


class Event:
    """A CUDA event, with timing unless ``timing=False`` (cheaper to record, for ordering and
    completion only); a ``cuda.core.Event`` underneath, as :attr:`core`."""

    def __init__(self, *, device: int | None = None, timing: bool = True):
        core = driver.cuda_core()
        dev = driver.core_device(device)
        self._event = driver.core_call(
            "cuEventCreate", dev.create_event, options=core.EventOptions(timing_enabled=timing)
        )

    @property
    def core(self) -> Any:
        """The ``cuda.core.Event``."""
        return self._event

    def record(self, stream: Any = None) -> Event:
        # Recorded through the driver so that any stream stream_handle accepts will do.
        driver.call(driver.cuda_driver().cuEventRecord, self._event.handle, stream_handle(stream))
        return self

    def synchronize(self) -> None:
        driver.core_call("cuEventSynchronize", self._event.sync)

    def wait_on(self, stream: Any = None) -> None:
        """Make ``stream`` wait (on the device) for the work recorded before this event."""
        driver.call(driver.cuda_driver().cuStreamWaitEvent, stream_handle(stream), self._event.handle, 0)

    @property
    def done(self) -> bool:
        """True once the work recorded before the event has finished."""
        return bool(driver.core_call("cuEventQuery", lambda: self._event.is_done))

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete)."""
        return float(driver.core_call("cuEventElapsedTime", lambda: end._event - self._event))

    def close(self) -> None:
        driver.core_call("cuEventDestroy", self._event.close)


def memset_d32_async(ptr: int, value: int, count: int, stream: Any = None) -> None:
    if count:
        driver.call(driver.cuda_driver().cuMemsetD32Async, ptr, value & 0xFFFFFFFF, count, stream_handle(stream))


def memcpy_2d_async(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width_bytes: int, rows: int, stream: Any = None
) -> None:
    """Device-to-device copy of ``rows`` rows of ``width_bytes`` between pitched layouts."""
    if not rows or not width_bytes:
        return
    cu = driver.cuda_driver()
    m = cu.CUDA_MEMCPY2D()
    m.srcMemoryType = m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcDevice, m.srcPitch = src, src_pitch
    m.dstDevice, m.dstPitch = dst, dst_pitch
    m.WidthInBytes, m.Height = width_bytes, rows
    driver.call(cu.cuMemcpy2DAsync, m, stream_handle(stream))


@dataclass(frozen=True)
class StreamOrder:
    """What decides whether two streams order their work: the handle, its kind (``legacy``,
    ``per_thread``, ``blocking`` or ``non_blocking``) and, for the per-thread default stream,
    the thread (each thread has its own). Taken when the stream is in use: a handle kept for
    later may name a stream destroyed since."""

    handle: int
    kind: str
    thread: int

    @classmethod
    def of(cls, handle: int) -> StreamOrder:
        if handle == 2 or (handle == 0 and _per_thread_default()):
            kind = "per_thread"
        elif handle in (0, 1):
            kind = "legacy"
        else:
            flags = int(driver.call(driver.cuda_driver().cuStreamGetFlags, handle))
            nb = int(driver.cuda_driver().CUstream_flags.CU_STREAM_NON_BLOCKING)
            kind = "non_blocking" if flags & nb else "blocking"
        return cls(handle, kind, threading.get_ident() if kind == "per_thread" else 0)

    def serialises_with(self, other: StreamOrder) -> bool:
        """True when work on one can only start after earlier work on the other: the same
        stream, or the legacy default stream with one that synchronises with it (a blocking
        stream, or a per-thread default stream)."""
        if self.kind == other.kind == "per_thread":
            return self.thread == other.thread
        if self.kind == other.kind == "legacy" or (self.handle == other.handle and self.kind != "per_thread"):
            return True
        if "legacy" in (self.kind, other.kind):
            rest = other.kind if self.kind == "legacy" else self.kind
            return rest in ("blocking", "per_thread")
        return False


def _per_thread_default() -> bool:
    """Whether handle 0 names the per-thread default stream in this process (cuda-bindings'
    switch for it)."""
    return os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")


def synchronize_stream(stream: Any = None) -> None:
    driver.call(driver.cuda_driver().cuStreamSynchronize, stream_handle(stream))
