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


def _nvjitlink() -> Any:
    try:
        from cuda.bindings import nvjitlink
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        raise LinkError("import cuda.bindings.nvjitlink", str(exc)) from exc
    return nvjitlink


@functools.cache
def nvjitlink_version() -> tuple[int, int]:
    """(major, minor) of the nvJitLink library (part of a linked kernel's cache key)."""
    try:
        major, minor = _nvjitlink().version()
    except Exception as exc:  # the library itself is missing: cuda-bindings loads it lazily
        raise LinkError(
            "nvJitLinkVersion",
            f"{type(exc).__name__}: {exc}",
            f"install the nvJitLink wheel: {INSTALL_HINT}",
        ) from exc
    return int(major), int(minor)


def _log(nvjitlink: Any, handle: Any, which: str) -> str:
    size = getattr(nvjitlink, f"get_{which}_log_size")(handle)
    if not size:
        return ""
    buf = bytearray(size)
    getattr(nvjitlink, f"get_{which}_log")(handle, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def link_cubin(cubin: bytes, libraries: Sequence[Path], *, arch: str, name: str) -> bytes:
    """Link NVRTC's relocatable ``cubin`` with the device ``libraries`` (archives) into a
    loadable cubin for ``arch`` ("sm_90a"). ``name``: the kernel, for messages."""
    nvjitlink = _nvjitlink()
    nvjitlink_version()  # a missing library is reported as such, not as a failed call below
    handle = nvjitlink.create(2, [f"-arch={arch}", "-O3"])
    step = "nvJitLinkAddData"
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, cubin, len(cubin), f"{name}.cubin")
        step = "nvJitLinkAddFile"
        for lib in libraries:
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, str(lib))
        step = "nvJitLinkComplete"
        nvjitlink.complete(handle)
        step = "nvJitLinkGetLinkedCubin"
        out = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, out)
        return bytes(out)
    except Exception as exc:
        log = _log(nvjitlink, handle, "error")
        raise LinkError(step, f"{type(exc).__name__}: {exc}", log, source_name=name) from exc
    finally:
        nvjitlink.destroy(handle)
