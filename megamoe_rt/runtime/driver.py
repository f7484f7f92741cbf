"""Thin, checked layer over ``cuda.bindings.driver`` and ``cuda.core``.

Every driver call goes through :func:`call`, which raises :class:`CudaError`
carrying the call's name and the CUresult name; what cuda.core does for us
(device properties, owned streams, events and buffers) goes through
:func:`core_call`, which turns cuda.core's errors into the same
:class:`CudaError` naming the driver call underneath. Kernel launches, module
loading and contexts stay on the driver API here (see :class:`LoadedKernel`).
Nothing here touches the driver at import time, so ``import megamoe_rt`` works
on machines with no GPU and no driver; the first GPU entry point raises a
one-line :class:`GpuUnavailableError` there instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megamoe_rt.runtime.errors import INSTALL_HINT
from megamoe_rt.runtime.errors import CudaError as CudaError  # re-exported: raised by every call here
from megamoe_rt.runtime.errors import GpuUnavailableError as GpuUnavailableError

HOPPER_CC = (9, 0)
_REQUIREMENT = "a Hopper GPU (sm_90: H100/H200) and a CUDA 12.4+ driver"

_lock = threading.Lock()
_init_error: str | None = None
_initialized = False


def cuda_driver() -> Any:
    """``cuda.bindings.driver`` (the one import of it: a missing package is a GpuUnavailableError)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # cuda-bindings is a base dependency; say so plainly
        raise GpuUnavailableError(f"cuda-bindings is not importable ({exc}); install: {INSTALL_HINT}") from None
    return driver


def _result_name(cu: Any, err: Any) -> str:
    name: str | None = getattr(err, "name", None)
    if name:
        return name
    try:
        res, raw = cu.cuGetErrorName(err)
        if raw:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # the name lookup is best effort; the code still identifies it
        pass
    return f"CUresult({int(err)})"


# Sticky kernel failures (CUDA_ERROR_ILLEGAL_ADDRESS .. CUDA_ERROR_LAUNCH_FAILED): a
# deadline-bounded wait that traps shows up as one of these on some later call.
_KERNEL_FAULTS = range(700, 720)


# Where a kernel fault can be explained (runtime/deadlines.py registers the timeout record
# a trapped wait leaves behind); kept as a hook so this module depends on nothing above it.
_fault_explainers: list[Callable[[], str | None]] = []


def register_fault_explainer(explain: Callable[[], str | None]) -> None:
    """``explain()`` is asked for a detail when a driver call reports a kernel fault."""
    if explain not in _fault_explainers:
        _fault_explainers.append(explain)


def _trap_detail(code: int) -> str:
    if code not in _KERNEL_FAULTS:
        return ""
    for explain in _fault_explainers:
        detail = explain()
        if detail:
            return detail
    return ""


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a driver function and unwrap its ``(CUresult, *values)`` tuple.

    Returns None, the single value, or a tuple of values.
    """
    cu = cuda_driver()
    out = fn(*args)
    if not isinstance(out, tuple):
        out = (out,)
    err, rest = out[0], out[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(fn.__name__, _result_name(cu, err), int(err), _trap_detail(int(err)))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


# cuda.core is imported on first use: it comes with the cu13/cu12 extras, and importing it
# costs time that `import megamoe_rt` should not pay.
_CORE_MIN = (1, 2)


def _core() -> Any:
    try:
        import cuda.core as core
    except ImportError as exc:
        raise GpuUnavailableError(f"cuda-core is not importable ({exc}); install: {INSTALL_HINT}") from None
    try:
        have = tuple(int(p) for p in core.__version__.split(".")[:2])
    except (AttributeError, ValueError):  # a development build: trust it
        have = _CORE_MIN
    if have < _CORE_MIN:
        raise GpuUnavailableError(
            f"cuda-core {core.__version__} is too old; megamoe_rt needs cuda-core >= 1.2: {INSTALL_HINT}"
        )
    return core


def _is_core_cuda_error(exc: BaseException) -> bool:
    # cuda.core's CUDAError lives in a private module; match it by name and package.
    cls = type(exc)
    return any(c.__name__ == "CUDAError" and c.__module__.startswith("cuda.core") for c in cls.__mro__)


def _from_core_error(name: str, exc: BaseException) -> CudaError:
    """A cuda.core CUDAError (``"CUDA_ERROR_X: explanation"``) as our CudaError naming ``name``."""
    text = str(exc)
    head, _, rest = text.partition(":")
    head = head.strip()
    code = -1
    if head.startswith("CUDA_ERROR_"):
        try:
            code = int(getattr(cuda_driver().CUresult, head))
        except (AttributeError, GpuUnavailableError):
            pass
    if code < 0:
        head, rest = "CUDA_ERROR_UNKNOWN", text
    detail = "; ".join(d for d in (rest.strip(), _trap_detail(code)) if d)
    return CudaError(name, head, code, detail)


def core_call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call into cuda.core; its errors become :class:`CudaError` naming ``name`` (the driver
    call underneath, e.g. ``"cuStreamCreateWithPriority"``)."""
    try:
        return fn(*args, **kwargs)
    except (CudaError, GpuUnavailableError):
        raise
    except Exception as exc:
        if _is_core_cuda_error(exc):
            raise _from_core_error(name, exc) from exc
        if isinstance(exc, RuntimeError) and not isinstance(exc, NotImplementedError):
            # cuda.core's explained misuse (e.g. timing an unrecorded event)
            raise RuntimeError(f"{name}: {exc}") from exc
        raise


def _ensure_init() -> None:
    """cuInit once; remember a missing driver so later calls fail fast and alike."""
    global _initialized, _init_error
    if _initialized:
        return
    with _lock:
        if _initialized:
            return
        if _init_error is None:
            try:
                cu = cuda_driver()
                call(cu.cuInit, 0)
                _initialized = True
                return
            except GpuUnavailableError as exc:
                _init_error = str(exc)
            except CudaError as exc:
                _init_error = f"the CUDA driver failed to initialise ({exc.result}); megamoe_rt needs {_REQUIREMENT}"
            except Exception as exc:  # libcuda.so missing: pathfinder / OSError / RuntimeError
                _init_error = f"no NVIDIA driver found ({type(exc).__name__}); megamoe_rt needs {_REQUIREMENT}"
    raise GpuUnavailableError(_init_error)


def driver_available() -> bool:
    try:
        _ensure_init()
    except GpuUnavailableError:
        return False
    return True


def pointer_location(ptr: int) -> tuple[str, int | None]:
    """Where the driver says ``ptr`` points: ``("device", ordinal)`` for device (or managed)
    memory, ``("host", None)`` for host memory CUDA knows of (pinned, registered), and
    ``("unknown", None)`` for an address no CUDA context allocated, mapped or registered."""
    cu = cuda_driver()
    _ensure_init()
    attr = cu.CUpointer_attribute
    err, memtype = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if err != cu.CUresult.CUDA_SUCCESS:
        return "unknown", None
    if int(memtype) == int(cu.CUmemorytype.CU_MEMORYTYPE_HOST):
        return "host", None
    ordinal = call(cu.cuPointerGetAttribute, attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    return "device", int(ordinal)


def driver_version() -> tuple[int, int] | None:
    """(major, minor) of the installed driver's CUDA version, or None without a driver."""
    if not driver_available():
        return None
    v = call(cuda_driver().cuDriverGetVersion)
    return v // 1000, (v % 1000) // 10


def device_count() -> int:
    if not driver_available():
        return 0
    return int(call(cuda_driver().cuDeviceGetCount))


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory_bytes: int
    l2_cache_bytes: int
    max_smem_per_block_optin: int
    clock_khz: int
    pci_bus_id: str

    @property
    def is_hopper(self) -> bool:
        return self.compute_capability == HOPPER_CC


@functools.cache
def device_info(ordinal: int = 0) -> DeviceInfo:
    """What the kernels and heuristics need to know about a device (no context is created).

    Name, compute capability and attributes come from ``cuda.core.Device`` (which caches
    them); total memory (cuda.core has no property for it) and the PCI bus id come from
    the driver, so that nothing here starts CUDA runtime state.
    """
    _ensure_init()
    cu = cuda_driver()
    n = device_count()
    if not 0 <= ordinal < n:
        raise ValueError(f"device ordinal {ordinal} is out of range: this machine has {n} CUDA device(s)")
    dev = core_call("cuDeviceGet", _core().Device, ordinal)

    def read(dev: Any) -> tuple[Any, ...]:
        p = dev.properties
        return (
            dev.name,
            tuple(dev.compute_capability),
            p.multiprocessor_count,
            p.l2_cache_size,
            p.max_shared_memory_per_block_optin,
            p.clock_rate,
        )

    name, cc, sm_count, l2, smem_optin, clock = core_call("cuDeviceGetName/cuDeviceGetAttribute", read, dev)
    raw = call(cu.cuDeviceGet, ordinal)
    bus = call(cu.cuDeviceGetPCIBusId, 32, raw)
    bus = bus.split(b"\0", 1)[0].decode(errors="replace") if isinstance(bus, bytes) else str(bus)
    return DeviceInfo(
        ordinal=ordinal,
        name=str(name),
        compute_capability=(int(cc[0]), int(cc[1])),
        sm_count=int(sm_count),
        total_memory_bytes=int(call(cu.cuDeviceTotalMem, raw)),
        l2_cache_bytes=int(l2),
        max_smem_per_block_optin=int(smem_optin),
        clock_khz=int(clock),
        pci_bus_id=bus,
    )


def list_devices() -> list[DeviceInfo]:
    return [device_info(i) for i in range(device_count())]


def require_hopper(ordinal: int | None = None) -> DeviceInfo:
    """The device a GPU entry point will run on, or a one-line RuntimeError."""
    _ensure_init()
    if device_count() == 0:
        raise GpuUnavailableError(f"no CUDA device is visible; megamoe_rt needs {_REQUIREMENT}")
    if ordinal is None:
        ordinal = current_device()
    info = device_info(ordinal)
    if not info.is_hopper:
        cc = "{}.{}".format(*info.compute_capability)
        raise GpuUnavailableError(
            f"device {ordinal} ({info.name}) has compute capability {cc}; megamoe_rt kernels need sm_90 (H100/H200)"
        )
    return info


# --- contexts -----------------------------------------------------------------

_primary_ctx: dict[int, Any] = {}


def current_device() -> int:
    """The device of the current context; CuPy's current device if CuPy is loaded; else 0."""
    _ensure_init()
    cu = cuda_driver()
    ctx = call(cu.cuCtxGetCurrent)
    if ctx is not None and int(ctx) != 0:
        return int(call(cu.cuCtxGetDevice))
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return int(cupy.cuda.runtime.getDevice())
    return 0


def ensure_context(ordinal: int | None = None) -> Any:
    """Make a context for ``ordinal`` current (its primary context unless one already is).

    CuPy and the CUDA runtime use the primary context, so arrays allocated by
    either are valid in the kernels launched here.
    """
    _ensure_init()
    if ordinal is None:
        ordinal = current_device()
    ctx = _current_context_on(ordinal)
    if ctx is None:
        ctx = _primary_context(ordinal)
        call(cuda_driver().cuCtxSetCurrent, ctx)
    return ctx


def context_for(ordinal: int) -> Any:
    """A context on GPU ``ordinal`` for work that names its context (graph nodes): the current
    one when it is on that GPU, else the GPU's primary context, which is not made current (the
    caller's current device stays as it was)."""
    _ensure_init()
    ctx = _current_context_on(ordinal)
    return _primary_context(ordinal) if ctx is None else ctx


def _current_context_on(ordinal: int) -> Any:
    """The calling thread's current context if it is on GPU ``ordinal``, else None."""
    cu = cuda_driver()
    ctx = call(cu.cuCtxGetCurrent)
    if ctx is not None and int(ctx) != 0 and int(call(cu.cuCtxGetDevice)) == ordinal:
        return ctx
    return None


def _primary_context(ordinal: int) -> Any:
    """GPU ``ordinal``'s primary context, retained once per process."""
    cu = cuda_driver()
    with _lock:
        pctx = _primary_ctx.get(ordinal)
        if pctx is None:
            dev = call(cu.cuDeviceGet, ordinal)
            pctx = call(cu.cuDevicePrimaryCtxRetain, dev)
            _primary_ctx[ordinal] = pctx
    return pctx


_tls = threading.local()


def core_device(ordinal: int | None = None) -> Any:
    """The ``cuda.core.Device`` for ``ordinal`` (default: the current device), ready to create
    streams, events and buffers in this thread.

    cuda.core wants ``Device.set_current()`` once per thread before it creates anything;
    that makes the primary context current, so a context that :func:`ensure_context` found
    current (a green context's, say) is made current again afterwards.
    """
    cu = cuda_driver()
    ctx = ensure_context(ordinal)
    if ordinal is None:
        ordinal = int(call(cu.cuCtxGetDevice))
    dev = core_call("cuDeviceGet", _core().Device, ordinal)
    ready = _tls.__dict__.setdefault("core_ready", set())
    if ordinal not in ready:
        core_call("cuCtxSetCurrent", dev.set_current)
        if int(call(cu.cuCtxGetCurrent)) != int(ctx):
            call(cu.cuCtxSetCurrent, ctx)
        ready.add(ordinal)
    return dev


# --- streams and events ---------------------------------------------------------


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
    if isinstance(stream, Stream):
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
    core = _core()
    if isinstance(stream, core.Stream):
        return stream
    if isinstance(stream, Stream):
        return stream.core
    handle = stream_handle(stream)
    if handle in (0, 1):  # 0 and CU_STREAM_LEGACY both name the legacy default stream
        return core.LEGACY_DEFAULT_STREAM
    if handle == 2:  # CU_STREAM_PER_THREAD
        return core.PER_THREAD_DEFAULT_STREAM
    return core_call("cuStreamGetCtx", core.Stream.from_handle, handle)


class Stream:
    """An owned CUDA stream on a device's primary context (a ``cuda.core.Stream``
    underneath, as :attr:`core`); destroyed by :meth:`close` or when it goes away."""

    def __init__(self, *, non_blocking: bool = True, priority: int | None = None, device: int | None = None):
        core = _core()
        dev = core_device(device)
        self.device = int(dev.device_id)
        options = core.StreamOptions(nonblocking=non_blocking, priority=priority)
        self._stream = core_call("cuStreamCreateWithPriority", dev.create_stream, options=options)
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
        core_call("cuStreamSynchronize", self.core.sync)

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self._handle = None
            core_call("cuStreamDestroy", self._stream.close)


class Event:
    """A CUDA event, with timing unless ``timing=False`` (cheaper to record, for ordering and
    completion only); a ``cuda.core.Event`` underneath, as :attr:`core`."""

    def __init__(self, *, device: int | None = None, timing: bool = True):
        core = _core()
        dev = core_device(device)
        self._event = core_call("cuEventCreate", dev.create_event, options=core.EventOptions(timing_enabled=timing))

    @property
    def core(self) -> Any:
        """The ``cuda.core.Event``."""
        return self._event

    def record(self, stream: Any = None) -> Event:
        # Recorded through the driver so that any stream stream_handle accepts will do.
        call(cuda_driver().cuEventRecord, self._event.handle, stream_handle(stream))
        return self

    def synchronize(self) -> None:
        core_call("cuEventSynchronize", self._event.sync)

    def wait_on(self, stream: Any = None) -> None:
        """Make ``stream`` wait (on the device) for the work recorded before this event."""
        call(cuda_driver().cuStreamWaitEvent, stream_handle(stream), self._event.handle, 0)

    @property
    def done(self) -> bool:
        """True once the work recorded before the event has finished."""
        return bool(core_call("cuEventQuery", lambda: self._event.is_done))

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and complete)."""
        return float(core_call("cuEventElapsedTime", lambda: end._event - self._event))

    def close(self) -> None:
        core_call("cuEventDestroy", self._event.close)


def memset_d32_async(ptr: int, value: int, count: int, stream: Any = None) -> None:
    if count:
        call(cuda_driver().cuMemsetD32Async, ptr, value & 0xFFFFFFFF, count, stream_handle(stream))


def memcpy_2d_async(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width_bytes: int, rows: int, stream: Any = None
) -> None:
    """Device-to-device copy of ``rows`` rows of ``width_bytes`` between pitched layouts."""
    if not rows or not width_bytes:
        return
    cu = cuda_driver()
    m = cu.CUDA_MEMCPY2D()
    m.srcMemoryType = m.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcDevice, m.srcPitch = src, src_pitch
    m.dstDevice, m.dstPitch = dst, dst_pitch
    m.WidthInBytes, m.Height = width_bytes, rows
    call(cu.cuMemcpy2DAsync, m, stream_handle(stream))


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
            flags = int(call(cuda_driver().cuStreamGetFlags, handle))
            nb = int(cuda_driver().CUstream_flags.CU_STREAM_NON_BLOCKING)
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


def stream_is_capturing(stream: Any = None) -> bool:
    cu = cuda_driver()
    status = call(cu.cuStreamIsCapturing, stream_handle(stream))
    return bool(status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


def free_memory_bytes(ordinal: int | None = None) -> int:
    """Device memory free now (cuMemGetInfo, in the device's primary context)."""
    ensure_context(ordinal)
    free, _total = call(cuda_driver().cuMemGetInfo)
    return int(free)


def synchronize_device(ordinal: int | None = None) -> None:
    """Wait for all work on a device (its primary context)."""
    ensure_context(ordinal)
    call(cuda_driver().cuCtxSynchronize)


def synchronize_stream(stream: Any = None) -> None:
    call(cuda_driver().cuStreamSynchronize, stream_handle(stream))


# --- memory ---------------------------------------------------------------------


class DeviceMemory:
    """Device memory from the device's memory pool (``cuda.core`` ``Device.allocate``, a
    ``Buffer`` underneath, as :attr:`core`); freed by :meth:`free` or when it goes away.

    With ``stream`` given, allocation and free are ordered on it (use the memory on that
    stream, or after it). Without, the memory is usable on every stream when the
    constructor returns, and :meth:`free` first waits for the device's work, as
    ``cuMemAlloc`` / ``cuMemFree`` did: a pool may hand freed memory to the next
    allocation as soon as the freeing stream allows.
    """

    def __init__(self, nbytes: int, *, stream: Any = None, device: int | None = None):
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        dev = core_device(device)
        self.nbytes = int(nbytes)
        self._ordered = stream is not None
        self._stream = core_stream(stream) if self._ordered else _core().LEGACY_DEFAULT_STREAM
        self._buf = core_call("cuMemAllocFromPoolAsync", dev.allocate, max(self.nbytes, 1), stream=self._stream)
        if not self._ordered:
            core_call("cuStreamSynchronize", self._stream.sync)
        self._ptr: int | None = int(self._buf.handle)

    @property
    def ptr(self) -> int:
        if self._ptr is None:
            raise ValueError("DeviceMemory: already freed")
        return self._ptr

    @property
    def core(self) -> Any:
        """The ``cuda.core.Buffer``."""
        return self._buf

    def memset_u8(self, value: int, stream: Any = None, nbytes: int | None = None, offset: int = 0) -> None:
        n = self.nbytes - offset if nbytes is None else nbytes
        call(cuda_driver().cuMemsetD8Async, self.ptr + offset, value & 0xFF, n, stream_handle(stream))

    def copy_from_host(self, data: bytes | memoryview, offset: int = 0) -> None:
        mv = memoryview(data).cast("B")
        if offset + mv.nbytes > self.nbytes:
            raise ValueError(f"copy of {mv.nbytes} bytes at offset {offset} overflows a {self.nbytes}-byte allocation")
        call(cuda_driver().cuMemcpyHtoD, self.ptr + offset, mv, mv.nbytes)

    def copy_to_host(self, nbytes: int | None = None, offset: int = 0) -> bytearray:
        n = self.nbytes - offset if nbytes is None else nbytes
        out = bytearray(n)
        call(cuda_driver().cuMemcpyDtoH, out, self.ptr + offset, n)
        return out

    def free(self) -> None:
        if getattr(self, "_ptr", None) is None:
            return
        self._ptr = None
        if not self._ordered:
            call(cuda_driver().cuCtxSynchronize)
        core_call("cuMemFreeAsync", self._buf.close, self._stream)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass


# --- modules and launches -----------------------------------------------------------


def _launch_config(
    grid: Sequence[int],
    block: Sequence[int],
    smem: int,
    stream: int,
    *,
    cluster: Sequence[int] | None = None,
    cooperative: bool = False,
    programmatic: bool = False,
) -> Any:
    cu = cuda_driver()
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.hStream = cu.CUstream(stream)
    attrs = []
    if cluster is not None:
        c = tuple(cluster) + (1,) * (3 - len(cluster))
        if any(gi % ci for gi, ci in zip(grid, c)):
            raise ValueError(f"grid {tuple(grid)} is not a multiple of the cluster shape {c}")
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = c
        attrs.append(attr)
    if cooperative:
        # All blocks resident at once (or the launch fails): grid-wide barriers rely on it.
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    if programmatic:
        # Programmatic dependent launch: the kernel may start before the previous kernel in the
        # stream has finished; it waits for it with griddepcontrol.wait before using its results.
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


class LoadedKernel:
    """A kernel from a cubin loaded as a CUlibrary.

    Keeps both the context-independent ``CUkernel`` (green-context graph nodes
    take it) and the ``CUfunction`` for the current context (plain launches).
    """

    def __init__(self, cubin: bytes, lowered_name: str, *, dynamic_smem_bytes: int = 0):
        ensure_context()
        cu = cuda_driver()
        self.lowered_name = lowered_name
        self.library = call(cu.cuLibraryLoadData, cubin, None, None, 0, None, None, 0)
        self.kernel = call(cu.cuLibraryGetKernel, self.library, lowered_name.encode())
        self.function = call(cu.cuKernelGetFunction, self.kernel)
        self.dynamic_smem_bytes = int(dynamic_smem_bytes)
        if self.dynamic_smem_bytes > 48 * 1024:
            call(
                cu.cuFuncSetAttribute,
                self.function,
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.dynamic_smem_bytes,
            )

    def prefer_max_shared_memory(self) -> None:
        """Ask for the SM configuration with the most shared memory whenever this kernel runs.

        A kernel using little shared memory otherwise lets the driver shrink the shared
        memory of the SMs it runs on, and a block of another kernel that needs more cannot join
        them until they drain: a kernel whose blocks wait for such a kernel's work (a streamed
        call's consumer, waiting on the producer's kernels) must not do that to every SM."""
        cu = cuda_driver()
        call(
            cu.cuFuncSetAttribute,
            self.function,
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            int(cu.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED),
        )

    def attribute(self, name: str) -> int:
        cu = cuda_driver()
        attr = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}")
        return int(call(cu.cuFuncGetAttribute, attr, self.function))

    def launch(
        self,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[ctypes._SimpleCData[Any] | ctypes.Structure],
        *,
        stream: Any = None,
        smem_bytes: int | None = None,
        cluster: Sequence[int] | None = None,
        in_stream_context: bool = False,
        cooperative: bool = False,
        programmatic: bool = False,
    ) -> None:
        """Launch with ``args`` given as ctypes objects in parameter order.

        ``cluster``: thread-block-cluster shape; the grid must be a multiple of it.
        ``in_stream_context``: launch the context-independent ``CUkernel`` so it runs in the
        stream's own context (a green context's stream keeps it inside that partition).
        ``cooperative``: every block is resident at once, or the launch fails (grid barriers).
        ``programmatic``: programmatic dependent launch (the kernel must griddepcontrol.wait).
        """
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if min(g) <= 0 or min(b) <= 0:
            raise ValueError(f"grid {g} and block {b} must be positive")
        ptrs = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(a) for a in args])
        smem = self.dynamic_smem_bytes if smem_bytes is None else smem_bytes
        cu = cuda_driver()
        func = cu.CUfunction(int(self.kernel)) if in_stream_context else self.function
        if cluster is not None and tuple(cluster) in ((1,), (1, 1, 1)):
            cluster = None
        if cluster is None and not cooperative and not programmatic:
            call(cu.cuLaunchKernel, func, *g, *b, smem, stream_handle(stream), ctypes.addressof(ptrs), 0)
            return
        cfg = _launch_config(
            g, b, smem, stream_handle(stream), cluster=cluster, cooperative=cooperative, programmatic=programmatic
        )
        call(cu.cuLaunchKernelEx, cfg, func, ctypes.addressof(ptrs), 0)

    def max_active_clusters(self, block: Sequence[int], cluster: Sequence[int], smem_bytes: int | None = None) -> int:
        """How many clusters of this shape can be resident at once (persistent grids size by it).

        Not every SM can host a cluster member (GPCs with an odd SM count leave one out),
        so a persistent grid of sm_count / cluster_size clusters may not fit in one wave.
        """
        key = (tuple(block), tuple(cluster), smem_bytes)
        cache: dict[tuple[tuple[int, ...], tuple[int, ...], int | None], int] = self.__dict__.setdefault(
            "_cluster_occupancy", {}
        )
        if key not in cache:
            smem = self.dynamic_smem_bytes if smem_bytes is None else smem_bytes
            b = tuple(block) + (1,) * (3 - len(block))
            c = tuple(cluster) + (1,) * (3 - len(cluster))
            cfg = _launch_config(c, b, smem, 0, cluster=c)
            cache[key] = int(call(cuda_driver().cuOccupancyMaxActiveClusters, self.function, cfg))
        return cache[key]

    def max_active_blocks_per_sm(self, block_threads: int, smem_bytes: int | None = None) -> int:
        smem = self.dynamic_smem_bytes if smem_bytes is None else smem_bytes
        return int(call(cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor, self.function, block_threads, smem))

    def __del__(self) -> None:
        try:
            if getattr(self, "library", None) is not None:
                cuda_driver().cuLibraryUnload(self.library)
        except Exception:
            pass
