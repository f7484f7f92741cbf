"""megamoe_rt: an expert-parallel FP8 MoE FFN runtime for NVIDIA Hopper (sm_90a).

Importing the package needs no GPU and no driver; GPU entry points raise a
one-line :class:`GpuUnavailableError` (a RuntimeError) where none is usable, and scripts
that call :func:`require_gpu` first end with that one line (exit status 1) instead.
"""

from __future__ import annotations

from megamoe_rt._version import __version__
from megamoe_rt.runtime.errors import CudaError, DeviceInputError, GpuUnavailableError, NvrtcError

# Heavier pieces load on first use so `import megamoe_rt` stays cheap.
_LAZY = {
    "quantize_fp8": ("megamoe_rt.kernels.quantize", "quantize_fp8"),
    "quantize_weight_fp8": ("megamoe_rt.kernels.quantize", "quantize_weight_fp8"),
    "MegaMoE": ("megamoe_rt.layer", "MegaMoE"),
    "grouped_gemm_fp8": ("megamoe_rt.kernels.grouped_gemm", "grouped_gemm_fp8"),
    "plan_grouped_gemm_fp8": ("megamoe_rt.kernels.grouped_gemm", "plan_grouped_gemm_fp8"),
    "calc_diff": ("megamoe_rt.reference", "calc_diff"),
    "symm_buffer_layout": ("megamoe_rt.schedule.layout", "symm_buffer_layout"),
    "get_preset": ("megamoe_rt.presets", "get_preset"),
    "PRESETS": ("megamoe_rt.presets", "PRESETS"),
    # Streamed calls: the ring's shape, a producer that copies chunks in, the reference router.
    "StreamConfig": ("megamoe_rt.schedule.streaming", "StreamConfig"),
    "ChunkWriter": ("megamoe_rt.streaming", "ChunkWriter"),
    "Router": ("megamoe_rt.routers", "Router"),
    # Scripts call it before importing CuPy: one line and exit status 1 where something is missing.
    "require_gpu": ("megamoe_rt.requirements", "require_gpu"),
}

__all__ = ["__version__", "CudaError", "DeviceInputError", "GpuUnavailableError", "NvrtcError", *_LAZY]


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'megamoe_rt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
