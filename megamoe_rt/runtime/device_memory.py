"""Device memory from a device's memory pool (cuda.core's ``Device.allocate``)."""

from __future__ import annotations

from typing import Any

from megamoe_rt.runtime import driver
from megamoe_rt.runtime.streams import core_stream, stream_handle


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
        dev = driver.core_device(device)
        self.nbytes = int(nbytes)
        self._ordered = stream is not None
        self._stream = core_stream(stream) if self._ordered else driver.cuda_core().LEGACY_DEFAULT_STREAM
        self._buf = driver.core_call("cuMemAllocFromPoolAsync", dev.allocate, max(self.nbytes, 1), stream=self._stream)
        if not self._ordered:
            driver.core_call("cuStreamSynchronize", self._stream.sync)
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
        driver.call(driver.cuda_driver().cuMemsetD8Async, self.ptr + offset, value & 0xFF, n, stream_handle(stream))

    def copy_from_host(self, data: bytes | memoryview, offset: int = 0) -> None:
        mv = memoryview(data).cast("B")
        if offset + mv.nbytes > self.nbytes:
            raise ValueError(f"copy of {mv.nbytes} bytes at offset {offset} overflows a {self.nbytes}-byte allocation")
        driver.call(driver.cuda_driver().cuMemcpyHtoD, self.ptr + offset, mv, mv.nbytes)

    def copy_to_host(self, nbytes: int | None = None, offset: int = 0) -> bytearray:
        n = self.nbytes - offset if nbytes is None else nbytes
        out = bytearray(n)
        driver.call(driver.cuda_driver().cuMemcpyDtoH, out, self.ptr + offset, n)
        return out

    def free(self) -> None:
        if getattr(self, "_ptr", None) is None:
            return
        self._ptr = None
        if not self._ordered:
            driver.call(driver.cuda_driver().cuCtxSynchronize)
        driver.core_call("cuMemFreeAsync", self._buf.close, self._stream)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass
