"""Compiled-and-loaded kernels, one per (variant, device), loaded on first use.

A kernel linked with NVSHMEM's device library is loaded only where NVSHMEM runs in the process,
and its library is handed NVSHMEM's device state (nvshmemx_culibrary_init) right after the load.

Loading also checks the kernel's parameters against its KernelSpec's declared list (once
per load, never per launch): the driver reports each parameter's size in the compiled
kernel, and a ctypes value of another size would be read as garbage by the device.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from megamoe_rt.jit import KernelSpec, compile_kernel
from megamoe_rt.runtime import driver, kernel_launch
from megamoe_rt.runtime.errors import CudaError

_loaded: dict[tuple[str, int], kernel_launch.LoadedKernel] = {}
_lock = threading.Lock()

# index -> (offset, size) of that parameter, or None past the last one.
ParamInfo = Callable[[int], tuple[int, int] | None]


class KernelParamMismatch(RuntimeError):
    """A loaded kernel's parameters differ from the ones its KernelSpec declares."""


def get_kernel(spec: KernelSpec, device: int) -> kernel_launch.LoadedKernel:
    key = (spec.name, device)
    k = _loaded.get(key)
    if k is not None:
        return k
    with _lock:
        k = _loaded.get(key)
        if k is None:
            nvshmem_rt = None
            if "nvshmem" in spec.device_libraries:  # checked before anything is built or loaded
                from megamoe_rt.ep.symm import NvshmemRuntime

                nvshmem_rt = NvshmemRuntime.require_device_api(spec.name, device)
            compiled = compile_kernel(spec)
            driver.ensure_context(device)
            k = kernel_launch.LoadedKernel(
                compiled.cubin, compiled.lowered_name, dynamic_smem_bytes=spec.dynamic_smem_bytes
            )
            if nvshmem_rt is not None:
                nvshmem_rt.init_device_library(k.library, spec.name, lambda: forget({spec.name}, device))
            if spec.params:
                info = driver_param_info(k)
                if info is not None:
                    check_param_sizes(spec.name, spec.params, info)
            _loaded[key] = k
    return k


def forget(names: set[str], device: int) -> None:
    """Drop the loaded kernels ``names`` on ``device``: the next get_kernel loads them again
    (kernels whose library was handed NVSHMEM's device state, once NVSHMEM ends)."""
    with _lock:
        for name in names:
            _loaded.pop((name, device), None)


def _type_name(t: type) -> str:
    if issubclass(t, ctypes.Array):
        arr: Any = t  # a ctypes array type: its element type and length
        return f"{_type_name(arr._type_)}[{arr._length_}]"
    return t.__name__


def check_param_sizes(name: str, declared: Sequence[type], info: ParamInfo) -> None:
    """Raises KernelParamMismatch unless the kernel has exactly the declared parameters, each of
    the declared ctypes type's size."""
    for i, t in enumerate(declared):
        found = info(i)
        if found is None:
            raise KernelParamMismatch(
                f"kernel {name}: its KernelSpec declares {len(declared)} parameters but the loaded kernel takes {i}"
            )
        offset, size = found
        want = ctypes.sizeof(t)
        if size != want:
            raise KernelParamMismatch(
                f"kernel {name}: parameter {i} is declared as {_type_name(t)} ({want} bytes) but the loaded kernel's "
                f"is {size} bytes (at offset {offset}); the host and device declarations differ (structs: "
                f"megamoe_rt/kernels/interface, then python -m megamoe_rt.kernels.interface)"
            )
    if info(len(declared)) is not None:
        n = len(declared)
        while info(n) is not None:
            n += 1
        raise KernelParamMismatch(
            f"kernel {name}: its KernelSpec declares {len(declared)} parameters but the loaded kernel takes {n}"
        )


class _Unsupported(Exception):
    pass


def driver_param_info(kernel: Any, cu: Any = None) -> ParamInfo | None:
    """The parameter query of a loaded kernel: cuKernelGetParamInfo (CUDA 12.4+), else
    cuFuncGetParamInfo; None where neither the bindings nor the driver have one."""
    if cu is None:
        cu = importlib.import_module("cuda.bindings.driver")
    candidates = [
        ("cuKernelGetParamInfo", getattr(kernel, "kernel", None)),
        ("cuFuncGetParamInfo", getattr(kernel, "function", None)),
    ]
    for fn_name, handle in candidates:
        fn = getattr(cu, fn_name, None)
        if fn is None or handle is None:
            continue
        query = _make_query(cu, fn, handle)
        try:
            query(0)
        except _Unsupported:
            continue
        return query
    return None


def _make_query(cu: Any, fn: Callable[..., Any], handle: Any) -> ParamInfo:
    first = True

    def query(index: int) -> tuple[int, int] | None:
        nonlocal first
        try:
            out = fn(handle, index)
        except RuntimeError as exc:  # the bindings know the call but this driver lacks it
            raise _Unsupported from exc
        err = out[0]
        if err == cu.CUresult.CUDA_SUCCESS:
            first = False
            return int(out[1]), int(out[2])
        if err == cu.CUresult.CUDA_ERROR_INVALID_VALUE:
            first = False
            return None  # past the last parameter
        if first:  # any other answer to the first query: this driver cannot say (the check is skipped)
            raise _Unsupported
        raise CudaError(getattr(fn, "__name__", "cuKernelGetParamInfo"), getattr(err, "name", str(err)), int(err))

    return query
