"""Exception types shared by the driver, JIT and kernel layers."""

from __future__ import annotations

from dataclasses import dataclass


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


# What a missing piece of the GPU stack (CuPy, cuda-core, NVRTC, nvJitLink, cuRAND, NVSHMEM)
# points to: pyproject.toml's extras install all of it. Kept here, the bottom of the package,
# so the driver layer and the entry points' checks (megamoe_rt/requirements.py) say the same.
INSTALL_COMMAND = 'pip install "megamoe-rt[cu13]"'
INSTALL_HINT = f'{INSTALL_COMMAND} ("megamoe-rt[cu12]" for a CUDA 12 driver)'


class GpuUnavailableError(RuntimeError):
    """A GPU entry point was called where no usable Hopper GPU is present.

    The message is one line saying what is needed.
    """


@dataclass(frozen=True)
class Finding:
    """One reported kind of error: ``kind`` (an ErrorKind key such as ``"expert_id_out_of_range"``)
    and the two details the kernel stored (what they mean depends on the kind)."""

    kind: str
    where: int
    what: int

    @property
    def what_signed(self) -> int:
        """``what`` read as a signed 32-bit number (an expert id of -5 comes back as -5)."""
        return self.what - (1 << 32) if self.what >= 1 << 31 else self.what


class DeviceInputError(ValueError):
    """Inputs that a kernel refused on the device. ``findings`` lists what was reported, one
    :class:`Finding` per kind; the message names the argument at fault."""

    def __init__(self, message: str, findings: tuple[Finding, ...]):
        super().__init__(message)
        self.findings = findings
