"""Probe and synthetic workloads for partition experiments (cuda_src/probe/)."""

from __future__ import annotations

import ctypes

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.interface.structs import SmProbeParams as SmProbeParams
from megamoe_rt.kernels.interface.structs import StreamCopyParams as StreamCopyParams
from megamoe_rt.kernels.interface.structs import StreamOrderProbeParams as StreamOrderProbeParams
from megamoe_rt.kernels.interface.structs import WaitContext

SPEC = KernelSpec(
    name="sm_probe",
    source="probe/sm_probe.cu",
    entry="megamoe_rt::probe::sm_probe",
    block_threads=32,
    params=(SmProbeParams,),
)


COPY_SPEC = KernelSpec(
    name="stream_copy",
    source="probe/stream_copy.cu",
    entry="megamoe_rt::probe::stream_copy",
    block_threads=256,
    params=(StreamCopyParams,),
)


# wait_for_signal(word, expected, timeout_ns, rank, peer, seen_out, record): scalars, no struct.
WAIT_SPEC = KernelSpec(
    name="wait_for_signal",
    source="probe/wait_timeout.cu",
    entry="megamoe_rt::probe::wait_for_signal",
    block_threads=32,
    uses_printf=True,
    params=(
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.c_uint64,
        ctypes.c_uint64,
    ),
)


# wait_for_mbarrier(ctx, arrive, peer): an mbarrier wait with a deadline.
MBARRIER_WAIT_SPEC = KernelSpec(
    name="wait_for_mbarrier",
    source="probe/wait_timeout.cu",
    entry="megamoe_rt::probe::wait_for_mbarrier",
    block_threads=64,
    params=(WaitContext, ctypes.c_uint32, ctypes.c_uint32),
)


# The fused kernel's task order dumped tile by tile, for tests/gpu/test_task_order_gpu.py (arguments
# and shared memory: the header comment of probe/task_order_walker.cu).
TASK_ORDER_SPEC = KernelSpec(
    name="task_order_walker",
    source="probe/task_order_walker.cu",
    entry="megamoe_rt::probe::task_order_walker",
    block_threads=32,
    params=(ctypes.c_uint64,) + (ctypes.c_uint32,) * 6 + (ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64),
)


# stream_order_walker(params): a streamed call's reservations, ready list and ticket order
# without GEMMs (the header comment of probe/stream_order_walker.cu); warp 0 takes tickets,
# warp 1 dispatches.
STREAM_ORDER_SPEC = KernelSpec(
    name="stream_order_walker",
    source="probe/stream_order_walker.cu",
    entry="megamoe_rt::probe::stream_order_walker",
    block_threads=64,
    params=(StreamOrderProbeParams,),
)


# NVSHMEM's device API linked in by nvJitLink (megamoe_rt/jit/link.py): dst, signal, out, peer.
# Not among kernel_specs(): it needs NVSHMEM's device library and nvJitLink, which the
# compile-only toolchains (the oldest NVRTC each CUDA extra allows) do not carry.
NVSHMEM_LINK_SPEC = KernelSpec(
    name="nvshmem_link_probe",
    source="probe/nvshmem_link_probe.cu",
    entry="megamoe_rt::probe::nvshmem_link_probe",
    needs=("cuda", "cccl"),
    device_libraries=("nvshmem",),
    block_threads=32,
    params=(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32),
)


def kernel_specs() -> list[KernelSpec]:
    return [SPEC, COPY_SPEC, WAIT_SPEC, MBARRIER_WAIT_SPEC, TASK_ORDER_SPEC, STREAM_ORDER_SPEC]


def device_link_specs() -> list[KernelSpec]:
    """Kernels that link a device library (compiled and linked by tests/cpu/test_device_link.py)."""
    return [NVSHMEM_LINK_SPEC]
