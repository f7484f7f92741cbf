"""Linking NVRTC's relocatable device code with device libraries, through nvJitLink.

A kernel that calls a device library (NVSHMEM's device API: ``nvshmem_ptr``, puts with a
signal, signal waits) is compiled by NVRTC with ``-rdc=true`` into a relocatable cubin and then
linked here with the library into a loadable cubin. What the toolchain accepts (checked by
tests/cpu/test_device_link.py on every CI run):

- NVSHMEM's wheels ship ``lib/libnvshmem_device.a``: host objects whose fatbins hold relocatable
  cubins for sm_75 ... sm_120 (sm_90, which links into sm_90a code). nvJitLink takes the
  archive as ``NVJITLINK_INPUT_LIBRARY`` next to NVRTC's cubin and resolves every
  ``nvshmem*`` symbol from it.
- NVRTC's ``-dlto`` LTO-IR links with the same archive as well (with ``-lto``); the cubin path
  is used, so ptxas reports the kernel's own registers and spills as for every other kernel.
- The ``lib/libnvshmem_device_sm_*.bc`` files beside it are LLVM bitcode, not LTO-IR:
  nvJitLink refuses them (``NVJITLINK_ERROR_INCORRECT_INPUT_TYPE``).
- Calls that reach a C++-mangled helper with a ``uint64_t`` parameter do not resolve: under
  NVRTC, CCCL's ``uint64_t`` is ``unsigned long long`` (mangled ``y``) while the archive was
  built by nvcc on Linux with ``unsigned long`` (``m``). In NVSHMEM 3.8 that is every
  put-with-signal (``nvshmem_*_put_signal*`` reach ``nvshmemi_transfer_put_signal_dispatch``).
  ``nvshmem_ptr``, ``nvshmem_p``/``putmem(_nbi)``, ``nvshmemx_signal_op``,
  ``nvshmem_signal_wait_until``, ``nvshmem_fence`` and ``nvshmem_quiet`` link; a put followed
  by ``nvshmem_fence`` and ``nvshmemx_signal_op`` to the same PE gives put-with-signal's order.

- NVSHMEM 3.4 (the version on the H200 test machines) compiles under NVRTC only with
  common/nvshmem_device_api.cuh (CCCL's type traits in std for one reduction header) and
  ``-default-device`` (one constructor without an execution space); 3.8 needs neither, and both
  link the same way (tests/cpu/test_device_link.py on CI's 3.8; on the GPU,
  tests/gpu/test_nvshmem_device_api_gpu.py with 3.4.5).

A module linked this way must be initialised by NVSHMEM after it is loaded (the device-side
NVSHMEM state it reads), before its first launch: megamoe_rt.kernels.loader hands each such
CUlibrary to ``nvshmemx_culibrary_init`` right after loading it, and refuses to load one in a
process where NVSHMEM does not run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megamoe_rt.runtime.core_import import import_cuda_core
from megamoe_rt.runtime.errors import INSTALL_HINT, NvrtcError


class LinkError(NvrtcError):
    """nvJitLink failed; ``log`` holds its error log."""

    def __init__(self, call: str, result: str, log: str = "", source_name: str = ""):
        super().__init__(call, result, log)
        if source_name:  # say what was being linked, not compiled
            self.source_name = source_name
            self.args = (
                str(self).replace(
                    f"{call} failed: {result}", f"{call} failed: {result} while linking {source_name}", 1
                ),
            )


def cuda_core() -> Any:
    """cuda.core, which compiles (Program) and links (Linker) every kernel
    (megamoe_rt/runtime/core_import.py), or an NvrtcError saying why not."""
    core, why = import_cuda_core()
    if core is None:
        raise NvrtcError("import cuda.core", why or "", f"install: {INSTALL_HINT}")
    return core


def is_cuda_core_error(exc: BaseException) -> bool:
    """An error cuda.core raised for a failed NVRTC or driver call (its CUDAError and NVRTCError
    live in a private module: matched by name and package)."""
    return any(c.__name__ == "CUDAError" and c.__module__.startswith("cuda.core") for c in type(exc).__mro__)


@functools.cache
def nvjitlink_version() -> tuple[int, int]:
    """(major, minor) of the nvJitLink library (part of a linked kernel's cache key). cuda.core
    has no public query for it: cuda.bindings, whose nvJitLink cuda.core's Linker runs."""
    try:
        from cuda.bindings import nvjitlink

        major, minor = nvjitlink.version()
    except Exception as exc:  # the library itself is missing: cuda-bindings loads it lazily
        raise LinkError(
            "nvJitLinkVersion",
            f"{type(exc).__name__}: {exc}",
            f"install the nvJitLink wheel: {INSTALL_HINT}",
        ) from exc
    return int(major), int(minor)


_LOG_IN_MESSAGE = "\nnvJitLink error log: "  # how cuda.core and cuda.bindings append the error log


def link_cubin(cubin: bytes, libraries: Sequence[Path], *, arch: str, name: str) -> bytes:
    """Link NVRTC's relocatable ``cubin`` with the device ``libraries`` (archives) into a
    loadable cubin for ``arch`` ("sm_90a"), with cuda.core's Linker on nvJitLink. ``name``:
    the kernel, for messages."""
    nvjitlink_version()  # a missing library is reported as such, not as a failed call below
    core = cuda_core()
    backend = str(core.Linker.which_backend())
    if backend != "nvJitLink":  # the driver's cuLink: another linker, one that needs a GPU driver
        raise LinkError(
            "Linker.which_backend", f"cuda.core would link with {backend}", f"nvJitLink: {INSTALL_HINT}", name
        )
    inputs = [
        core.ObjectCode.from_cubin(cubin, name=f"{name}.cubin"),
        *(core.ObjectCode.from_library(str(lib), name=lib.name) for lib in libraries),  # added as files
    ]
    options = core.LinkerOptions(name=name, arch=arch, optimization_level=3)
    linker = None
    step = "Linker"  # nvJitLinkCreate, then one nvJitLinkAddData / nvJitLinkAddFile per input
    try:
        linker = core.Linker(*inputs, options=options)
        step = "Linker.link"  # nvJitLinkComplete and the linked cubin
        return bytes(linker.link("cubin").code)
    except Exception as exc:
        head, _, log = str(exc).partition(_LOG_IN_MESSAGE)
        if linker is not None:
            log = linker.get_error_log()
        raise LinkError(step, f"{type(exc).__name__}: {head}", log.rstrip("\0"), source_name=name) from exc
    finally:
        if linker is not None:
            linker.close()
