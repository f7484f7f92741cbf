"""The SM probe kernel (cuda_src/probe/sm_probe.cu): %smid and %globaltimer per block."""

from __future__ import annotations

import ctypes

from ..jit import KernelSpec

SPEC = KernelSpec(name="sm_probe", source="probe/sm_probe.cu", entry="megamoe_rt::probe::sm_probe", block_threads=32)


class SmProbeParams(ctypes.Structure):
    _fields_ = [("smid", ctypes.c_uint64), ("start_ns", ctypes.c_uint64), ("end_ns", ctypes.c_uint64),
                ("spin_ns", ctypes.c_uint64)]


def kernel_specs() -> list[KernelSpec]:
    return [SPEC]
