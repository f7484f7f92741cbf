"""The host side of the kernels' input-error reports (cuda_src/common/error_report.cuh).

A kernel that meets a bad input keeps memory safe (drops the pair, skips the GEMM) and stores
one word per kind of error into an :class:`ErrorReport`, mapped pinned host memory. The host
reads those words with plain loads, so looking costs nothing and never waits for the stream;
the owner of a report (a layer, a GEMM plan) decides when to look and raises
:class:`DeviceInputError`.
"""

from __future__ import annotations

import ctypes

from megamoe_rt.kernels.interface import errors as decl
from megamoe_rt.kernels.interface.structs import ErrorReport as _ReportFields  # as it lies in host memory
from megamoe_rt.runtime import driver
from megamoe_rt.runtime.errors import DeviceInputError as DeviceInputError
from megamoe_rt.runtime.errors import Finding

ERROR_KINDS = tuple(decl.ERROR_KIND.keys())  # host keys, in ErrorKind order
_RAISED = decl.ERROR_RAISED.value


def decode(words: list[int]) -> tuple[Finding, ...]:
    """The findings of a report's words (one per ErrorKind, in order)."""
    out = []
    for kind, word in zip(ERROR_KINDS, words):
        if word & _RAISED:
            out.append(Finding(kind, (word >> 32) & 0x7FFFFFFF, word & 0xFFFFFFFF))
    return tuple(out)


class ErrorReport:
    """One report: ``device_ptr`` goes into the kernels' parameters; :meth:`peek` and
    :meth:`take` read it on the host without waiting for anything."""

    def __init__(self, device: int | None = None) -> None:
        cu = driver.cuda_driver()
        driver.ensure_context(device)
        self._size = ctypes.sizeof(_ReportFields)
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.host_ptr = int(driver.call(cu.cuMemHostAlloc, self._size, flags))
        ctypes.memset(self.host_ptr, 0, self._size)
        self.device_ptr = int(driver.call(cu.cuMemHostGetDevicePointer, self.host_ptr, 0))
        self._words = _ReportFields.from_address(self.host_ptr).words

    def pending(self, ignore: tuple[str, ...] = ()) -> bool:
        """True when some kernel has reported an error not yet taken (kinds in ``ignore``
        aside: their words stay until the next :meth:`take`)."""
        return any(self._words[i] for i, kind in enumerate(ERROR_KINDS) if kind not in ignore)

    def peek(self) -> tuple[Finding, ...]:
        """The reported findings, left in place."""
        return decode(list(self._words))

    def take(self) -> tuple[Finding, ...]:
        """The reported findings, cleared. Call it only once the work that could still report
        into it has finished (else a late store lands after the clear and is seen next time)."""
        found = self.peek()
        for i in range(len(ERROR_KINDS)):
            self._words[i] = 0
        return found

    def close(self) -> None:
        if getattr(self, "host_ptr", 0):
            ptr, self.host_ptr = self.host_ptr, 0
            self.device_ptr = 0
            try:
                driver.call(driver.cuda_driver().cuMemFreeHost, ptr)
            except Exception:  # interpreter shutdown, dead context: nothing to give back
                pass

    def __del__(self) -> None:
        self.close()
