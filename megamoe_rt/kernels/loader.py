"""Compiled-and-loaded kernels, one per (variant, device), loaded on first use."""

from __future__ import annotations

import threading

from megamoe_rt.runtime import driver
from megamoe_rt.jit import KernelSpec, compile_kernel

_loaded: dict[tuple[str, int], driver.LoadedKernel] = {}
_lock = threading.Lock()


def get_kernel(spec: KernelSpec, device: int) -> driver.LoadedKernel:
    key = (spec.name, device)
    k = _loaded.get(key)
    if k is not None:
        return k
    with _lock:
        k = _loaded.get(key)
        if k is None:
            compiled = compile_kernel(spec)
            driver.ensure_context(device)
            k = driver.LoadedKernel(compiled.cubin, compiled.lowered_name,
                                    dynamic_smem_bytes=spec.dynamic_smem_bytes)
            _loaded[key] = k
    return k
