"""Run-time compilation of cuda_src kernels (NVRTC, sm_90a) with a verified cubin cache."""

from megamoe_rt.jit.cache import CubinCache, default_cache_dir
from megamoe_rt.jit.compiler import ARCH, CompiledKernel, KernelSpec, compile_kernel, nvrtc_version
from megamoe_rt.jit.paths import cuda_src_dir, include_dirs
from megamoe_rt.jit.resources import KernelResources, parse_ptxas_report

__all__ = [
    "ARCH",
    "CompiledKernel",
    "CubinCache",
    "KernelResources",
    "KernelSpec",
    "compile_kernel",
    "cuda_src_dir",
    "default_cache_dir",
    "include_dirs",
    "nvrtc_version",
    "parse_ptxas_report",
]
