"""Exception types shared by the driver, JIT and kernel layers."""

from __future__ import annotations


class CudaError(RuntimeError):
    """A CUDA driver call returned something other than CUDA_SUCCESS.

    ``call`` is the driver function's name (``"cuMemAlloc"``), ``result`` the
    CUresult enum name (``"CUDA_ERROR_OUT_OF_MEMORY"``) and ``code`` its value.
    """

    def __init__(self, call: str, result: str, code: int, detail: str = ""):
        self.call = call
        self.result = result
        self.code = code
        self.detail = detail
        msg = f"{call} failed: {result} ({code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class NvrtcError(RuntimeError):
    """NVRTC failed; ``log`` holds the compiler's full output."""

    def __init__(self, call: str, result: str, log: str = "", source_name: str = ""):
        self.call = call
        self.result = result
        self.log = log
        self.source_name = source_name
        head = f"{call} failed: {result}"
        if source_name:
            head += f" while compiling {source_name}"
        super().__init__(head + (f"\n{log.rstrip()}" if log.strip() else ""))


class GpuUnavailableError(RuntimeError):
    """A GPU entry point was called where no usable Hopper GPU is present.

    The message is one line saying what is needed.
    """
