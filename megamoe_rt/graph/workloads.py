"""Built-in kernels a pipeline spec can name, for partition experiments.

- ``sm_probe``: each block spins ``spin_ns`` and records its SM and start/end time.
- ``stream_copy``: memory-bound copy of ``mib`` MiB (default 512).
- ``fp8_gemm``: compute-bound FP8 tensor-core GEMM (one group, ``m`` x ``n`` x ``k``,
  default 4096^3) on the project's grouped GEMM kernel; grid and block come from its config.

Each workload allocates its buffers once and gives the graph builder a kernel, a grid,
a block, dynamic shared memory and ctypes arguments.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from megamoe_rt.graph.spec import NodeSpec, SpecError
from megamoe_rt.runtime import kernel_launch
from megamoe_rt.schedule.arith import align_up

KNOWN = ("sm_probe", "stream_copy", "fp8_gemm")


@dataclass
class Workload:
    kernel: kernel_launch.LoadedKernel
    grid: int
    block: int
    smem: int
    args: list
    keep: list = field(default_factory=list)
    flops: float = 0.0
    bytes: float = 0.0


def make_workload(node: NodeSpec, device: int) -> Workload:
    import cupy as cp

    from megamoe_rt.kernels import probe
    from megamoe_rt.kernels.loader import get_kernel

    if node.kernel == "sm_probe":
        n = node.grid
        bufs = [cp.zeros(n, cp.uint32), cp.zeros(n, cp.uint64), cp.zeros(n, cp.uint64)]
        spin = int(node.args.get("spin_ns", 100_000))
        args: list[ctypes.Structure] = [probe.SmProbeParams(*(int(b.data.ptr) for b in bufs), spin)]
        return Workload(get_kernel(probe.SPEC, device), node.grid, node.block, 0, args, bufs)
    if node.kernel == "stream_copy":
        nbytes = int(node.args.get("mib", 512)) * 2**20
        src = cp.random.randint(0, 2**31, size=nbytes // 4, dtype=cp.int32)
        dst = cp.empty_like(src)
        args = [probe.StreamCopyParams(int(src.data.ptr), int(dst.data.ptr), nbytes // 16)]
        return Workload(
            get_kernel(probe.COPY_SPEC, device), node.grid, node.block, 0, args, [src, dst], bytes=2.0 * nbytes
        )
    if node.kernel == "fp8_gemm":
        return _gemm_workload(node, device)
    raise SpecError(f"node {node.name!r}: unknown kernel {node.kernel!r}; known: {', '.join(KNOWN)}")


def _gemm_workload(node: NodeSpec, device: int) -> Workload:
    import cupy as cp
    import numpy as np

    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8
    from megamoe_rt.kernels.quantize import quantize_fp8

    m, n, k = (int(node.args.get(key, 4096)) for key in ("m", "n", "k"))
    a, _ = quantize_fp8(cp.random.standard_normal((m, k), dtype=cp.float32))
    b, _ = quantize_fp8(cp.random.standard_normal((n, k), dtype=cp.float32))
    a_sf = cp.ones((k // 128, align_up(m, 4)), dtype=cp.float32)
    b_sf = cp.full((1, n // 128, k // 128), 1 / 64, dtype=cp.float32)
    offsets = cp.asarray(np.array([0, m], dtype=np.int32))
    out = cp.empty((m, n), dtype=cp.uint16)
    plan = plan_grouped_gemm_fp8(
        a, a_sf, b.reshape(1, n, k), b_sf, group_offsets=offsets, out=out, check_layout=False, a_sf_kmajor=True
    )
    g = plan.gemm
    if node.block != g.block:
        raise SpecError(f"node {node.name!r}: fp8_gemm runs {g.block} threads per block, the spec says {node.block}")
    # A persistent kernel: the spec's grid sets how many CTAs walk the tiles.
    return Workload(
        g.kernel,
        node.grid,
        g.block,
        g.kernel.dynamic_smem_bytes,
        g.args,
        [a, b, a_sf, b_sf, out, plan],
        flops=2.0 * m * n * k,
    )
