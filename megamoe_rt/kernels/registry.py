"""Every kernel variant the package builds, for `megamoe-rt compile --all` and CI.

Each kernel family contributes its specs here, so the CPU suite compiles and
resource-checks exactly what the GPU paths launch.
"""

from __future__ import annotations

from megamoe_rt.jit import KernelSpec


def all_kernel_specs() -> list[KernelSpec]:
    from megamoe_rt.kernels import ep, fused, gemm_heuristics, moe, probe, quantize, stream

    specs: list[KernelSpec] = []
    specs += quantize.kernel_specs()
    specs += gemm_heuristics.kernel_specs()
    specs += moe.kernel_specs()
    specs += fused.kernel_specs()
    specs += ep.kernel_specs()
    specs += probe.kernel_specs()
    specs += stream.kernel_specs()
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"duplicate kernel variant names: {sorted(dup)}")
    return specs
