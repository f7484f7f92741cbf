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

import threading
from collections.abc import Callable
from typing import Any

from megamoe_rt.runtime.core_import import import_cuda_core
from megamoe_rt.runtime.errors import INSTALL_HINT
from megamoe_rt.runtime.errors import CudaError as CudaError  # re-exported: raised by every call here
from megamoe_rt.runtime.errors import GpuUnavailableError as GpuUnavailableError

REQUIREMENT = "a Hopper GPU (sm_90: H100/H200) and a CUDA 12.4+ driver"

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


def cuda_core() -> Any:
    """cuda.core (megamoe_rt/runtime/core_import.py), or a one-line GpuUnavailableError."""
    core, why = import_cuda_core()
    if core is None:
        raise GpuUnavailableError(f"{why}: {INSTALL_HINT}")
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
                _init_error = f"the CUDA driver failed to initialise ({exc.result}); megamoe_rt needs {REQUIREMENT}"
            except Exception as exc:  # libcuda.so missing: pathfinder / OSError / RuntimeError
                _init_error = f"no NVIDIA driver found ({type(exc).__name__}); megamoe_rt needs {REQUIREMENT}"
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
    dev = core_call("cuDeviceGet", cuda_core().Device, ordinal)
    ready = _tls.__dict__.setdefault("core_ready", set())
    if ordinal not in ready:
        core_call("cuCtxSetCurrent", dev.set_current)
        if int(call(cu.cuCtxGetCurrent)) != int(ctx):
            call(cu.cuCtxSetCurrent, ctx)
        ready.add(ordinal)
    return dev


def free_memory_bytes(ordinal: int | None = None) -> int:
    """Device memory free now (cuMemGetInfo, in the device's primary context)."""
    ensure_context(ordinal)
    free, _total = call(cuda_driver().cuMemGetInfo)
    return int(free)


def synchronize_device(ordinal: int | None = None) -> None:
    """Wait for all work on a device (its primary context)."""
    ensure_context(ordinal)
    call(cuda_driver().cuCtxSynchronize)
