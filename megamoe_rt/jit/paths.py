"""Where device code and headers come from.

Headers are found in installed wheels only (nvidia-cuda-runtime, nvidia-cuda-cccl,
nvidia-cutlass, nvidia-nvshmem), never in /usr/local/cuda, so a build is reproducible from the
environment's package versions alone. So are the device libraries a kernel links
(NVSHMEM's device archive).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

from megamoe_rt.runtime.errors import INSTALL_HINT

_PKG_DIR = Path(__file__).resolve().parent.parent


@functools.cache
def cuda_src_dir() -> Path:
    """The device-code tree: inside the installed package, or the source checkout's."""
    for cand in (_PKG_DIR / "cuda_src", _PKG_DIR.parent / "cuda_src"):
        if (cand / "ptx").is_dir():
            return cand
    raise RuntimeError(f"megamoe_rt's cuda_src/ tree was not found next to {_PKG_DIR}; reinstall the package")


def _site_dirs() -> list[Path]:
    seen, out = set(), []
    for entry in sys.path:
        p = Path(entry or ".").resolve()
        if p not in seen and p.is_dir():
            seen.add(p)
            out.append(p)
    return out


# Candidate layouts, CUDA 13 wheels first (nvidia/cu13/...), then CUDA 12's per-component dirs.
_CUDA_HEADER_DIRS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include")
_CCCL_HEADER_DIRS = ("nvidia/cu13/include/cccl", "nvidia/cuda_cccl/include")
_NVSHMEM_DIR = "nvidia/nvshmem"


def _first_with(rel_dirs: tuple[str, ...], marker: str) -> Path | None:
    for site in _site_dirs():
        for rel in rel_dirs:
            d = site / rel
            if (d / marker).is_file():
                return d
    return None


@functools.cache
def include_dirs() -> dict[str, Path | None]:
    """Header sets a kernel may ask for: 'cuda', 'cccl', 'cutlass', 'nvshmem' -> directory or None."""
    cutlass = None
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
        if (d / "cute" / "tensor.hpp").is_file():
            cutlass = d
    return {
        "cuda": _first_with(_CUDA_HEADER_DIRS, "cuda_fp8.h"),
        "cccl": _first_with(_CCCL_HEADER_DIRS, "cuda/std/cstdint"),
        "cutlass": cutlass,
        "nvshmem": _first_with((_NVSHMEM_DIR + "/include",), "nvshmem.h"),
    }


@functools.cache
def device_libraries() -> dict[str, Path | None]:
    """Device libraries a kernel may link (KernelSpec.device_libraries) -> archive or None.

    'nvshmem': NVSHMEM's device-side API as host objects holding relocatable cubins per
    architecture (libnvshmem_device.a), from the same wheel as the host library that
    initialises it, so host and device sides are always one NVSHMEM version."""
    return {"nvshmem": _first_with((_NVSHMEM_DIR + "/lib",), "libnvshmem_device.a")}


def device_library_path(name: str) -> Path | None:
    d = device_libraries()[name]
    return None if d is None else d / f"lib{name}_device.a"


_WHEEL_FOR = {
    "cuda": ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12"),
    "cccl": ("nvidia-cuda-cccl", "nvidia-cuda-cccl-cu12"),
    "cutlass": ("nvidia-cutlass",),
    "nvshmem": ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
}


def header_set_version(name: str) -> str:
    """The wheel version a header set came from (part of the cache key)."""
    for dist in _WHEEL_FOR[name]:
        try:
            return f"{dist}=={md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return "unversioned"


def missing_header_message(name: str) -> str:
    wheel = _WHEEL_FOR[name][0]
    return f"the {name} headers were not found in any installed wheel ({wheel}); install: {INSTALL_HINT}"
