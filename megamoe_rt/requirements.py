"""What the entry points need before they start, and the one line that says what is missing.

``pip install megamoe-rt`` alone imports, plans and models. Compiling kernels needs cuda-core, NVRTC
and nvJitLink (header wheels only for the kernels that ask for them); running them also needs CuPy,
the CUDA runtime, cuRAND, NVSHMEM and a Hopper GPU: the cu13 (or cu12) extra and the machine. Every entry point
(the ``megamoe-rt`` commands, ``python -m megamoe_rt.cli.*``, the examples) asks here first,
so a missing piece ends the program with one line naming it and the install command, exit
status 1, instead of a traceback from deep inside CuPy or NVRTC. Under ``megamoe-rt launch``
each rank leaves that line to the launcher, which prints it once (megamoe_rt/ep/env.py).

Shared libraries are looked up as CuPy and cuda-bindings load them (cuda.pathfinder's
``load_nvidia_dynamic_lib``), so a library found here is the one they will load.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megamoe_rt.ep.env import leave_launch_report
from megamoe_rt.runtime.errors import INSTALL_HINT, GpuUnavailableError

if TYPE_CHECKING:
    from megamoe_rt.runtime.devices import DeviceInfo


@dataclass(frozen=True)
class Piece:
    """One thing the extras install: ``name`` as a message says it; ``kind`` and ``key`` say
    how it is found (an import name, or a cuda.pathfinder library name)."""

    name: str
    kind: str  # "package" | "library"
    key: str


PATHFINDER = Piece("cuda-pathfinder", "package", "cuda.pathfinder")
# What every kernel build needs. Header sets and device libraries only some kernels ask for
# (KernelSpec.needs / device_libraries: the CUDA, CCCL and NVSHMEM headers of the NVSHMEM link
# probe) are checked by that kernel's build, which names the missing wheel (jit.paths); asking
# for them here would refuse machines that run every other kernel.
# cuda-core runs NVRTC (Program) and nvJitLink (Linker) for megamoe_rt.jit.
COMPILER: tuple[Piece, ...] = (
    PATHFINDER,
    Piece("cuda-core", "package", "cuda.core"),
    Piece("NVRTC (libnvrtc)", "library", "nvrtc"),
    Piece("nvJitLink (libnvJitLink)", "library", "nvJitLink"),
)
GPU_STACK: tuple[Piece, ...] = (
    Piece("CuPy", "package", "cupy"),
    Piece("nvshmem4py", "package", "nvshmem"),
    *COMPILER,
    Piece("the CUDA runtime (libcudart)", "library", "cudart"),
    Piece("cuRAND (libcurand)", "library", "curand"),
    Piece("NVSHMEM's host library (libnvshmem_host)", "library", "nvshmem_host"),
)


def _package_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # the parent package is missing, or a module None in sys.modules
        return False


@functools.cache
def _library_found(name: str) -> bool:
    from cuda import pathfinder

    try:
        pathfinder.load_nvidia_dynamic_lib(name)
    except pathfinder.DynamicLibNotFoundError:
        return False
    except Exception:
        # A cuda.pathfinder that does not know the name cannot say; CuPy and cuda-bindings
        # look it up their own way then, and this check must not refuse a working install.
        return True
    return True


def found(piece: Piece) -> bool:
    if piece.kind == "package":
        return _package_found(piece.key)
    return _package_found(PATHFINDER.key) and _library_found(piece.key)


def missing(pieces: tuple[Piece, ...] = GPU_STACK) -> list[str]:
    """The names of the pieces not found, in order. Without cuda.pathfinder (the extras'
    cuda-bindings bring it) libraries are not looked for: it is named instead."""
    if not _package_found(PATHFINDER.key):
        pieces = tuple(p for p in pieces if p.kind != "library")
    return [p.name for p in pieces if not found(p)]


def stack_problem(pieces: tuple[Piece, ...] = GPU_STACK) -> str | None:
    """One line naming what of ``pieces`` is missing and the install command; None when all is there."""
    names = missing(pieces)
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{shown} not found (megamoe-rt's GPU stack comes with its cu13 or cu12 extra); install: {INSTALL_HINT}"


def check_gpu(ordinal: int | None = None) -> DeviceInfo:
    """The Hopper GPU to run on (``ordinal``, default the current device) once the whole GPU
    stack is there; a one-line :class:`GpuUnavailableError` otherwise."""
    problem = stack_problem(GPU_STACK)
    if problem is not None:
        raise GpuUnavailableError(problem)
    from megamoe_rt.runtime import devices

    return devices.require_hopper(ordinal)


def _program() -> str:
    """The running script's name (``quickstart`` for examples/quickstart.py)."""
    arg = sys.argv[0] if sys.argv else ""
    if not arg or arg in ("-c", "-m"):
        return "megamoe_rt"
    return os.path.splitext(os.path.basename(arg))[0]


def report(program: str, message: str) -> int:
    """``program: message`` as the program's one line on stderr (under ``megamoe-rt launch``,
    left to the launcher, which prints it once for every rank); the exit status to use, 1."""
    line = f"{program}: {(message.splitlines() or [''])[0]}"
    if not leave_launch_report(line):
        print(line, file=sys.stderr, flush=True)
    return 1


def gpu_or_report(program: str, ordinal: int | None = None) -> DeviceInfo | None:
    """:func:`check_gpu`, or None after :func:`report` said why not."""
    try:
        return check_gpu(ordinal)
    except (RuntimeError, ValueError) as exc:  # GpuUnavailableError, a driver call's CudaError, a bad ordinal
        report(program, str(exc))
        return None


def compiler_or_report(program: str) -> bool:
    """Whether kernels can be compiled here (NVRTC, nvJitLink; no GPU
    needed); False after :func:`report` said what is missing."""
    problem = stack_problem(COMPILER)
    if problem is not None:
        report(program, problem)
        return False
    return True


def require_gpu(program: str | None = None, *, ordinal: int | None = None) -> DeviceInfo:
    """For scripts, before they import CuPy: the Hopper GPU to run on, or the end of the
    program with one line naming what is missing (the GPU stack, the driver, a Hopper GPU)
    and exit status 1. ``program`` names the script in that line (default: its file name)."""
    info = gpu_or_report(program or _program(), ordinal)
    if info is None:
        raise SystemExit(1)
    return info
