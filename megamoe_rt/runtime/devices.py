"""The GPUs: what the kernels and heuristics need to know about a device, and the check every
GPU entry point makes (a Hopper GPU, or a one-line error)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megamoe_rt.runtime import driver
from megamoe_rt.runtime.errors import GpuUnavailableError

HOPPER_CC = (9, 0)


def driver_version() -> tuple[int, int] | None:
    """(major, minor) of the installed driver's CUDA version, or None without a driver."""
    if not driver.driver_available():
        return None
    v = driver.call(driver.cuda_driver().cuDriverGetVersion)
    return v // 1000, (v % 1000) // 10


def device_count() -> int:
    if not driver.driver_available():
        return 0
    return int(driver.call(driver.cuda_driver().cuDeviceGetCount))


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory_bytes: int
    l2_cache_bytes: int
    max_smem_per_block_optin: int
    clock_khz: int
    pci_bus_id: str

    @property
    def is_hopper(self) -> bool:
        return self.compute_capability == HOPPER_CC


@functools.cache
def device_info(ordinal: int = 0) -> DeviceInfo:
    """What the kernels and heuristics need to know about a device (no context is created).

    Name, compute capability and attributes come from ``cuda.core.Device`` (which caches
    them); total memory (cuda.core has no property for it) and the PCI bus id come from
    the driver, so that nothing here starts CUDA runtime state.
    """
    driver._ensure_init()
    cu = driver.cuda_driver()
    n = device_count()
    if not 0 <= ordinal < n:
        raise ValueError(f"device ordinal {ordinal} is out of range: this machine has {n} CUDA device(s)")
    dev = driver.core_call("cuDeviceGet", driver.cuda_core().Device, ordinal)

    def read(dev: Any) -> tuple[Any, ...]:
        p = dev.properties
        return (
            dev.name,
            tuple(dev.compute_capability),
            p.multiprocessor_count,
            p.l2_cache_size,
            p.max_shared_memory_per_block_optin,
            p.clock_rate,
        )

    name, cc, sm_count, l2, smem_optin, clock = driver.core_call("cuDeviceGetName/cuDeviceGetAttribute", read, dev)
    raw = driver.call(cu.cuDeviceGet, ordinal)
    bus = driver.call(cu.cuDeviceGetPCIBusId, 32, raw)
    bus = bus.split(b"\0", 1)[0].decode(errors="replace") if isinstance(bus, bytes) else str(bus)
    return DeviceInfo(
        ordinal=ordinal,
        name=str(name),
        compute_capability=(int(cc[0]), int(cc[1])),
        sm_count=int(sm_count),
        total_memory_bytes=int(driver.call(cu.cuDeviceTotalMem, raw)),
        l2_cache_bytes=int(l2),
        max_smem_per_block_optin=int(smem_optin),
        clock_khz=int(clock),
        pci_bus_id=bus,
    )


def list_devices() -> list[DeviceInfo]:
    return [device_info(i) for i in range(device_count())]


def require_hopper(ordinal: int | None = None) -> DeviceInfo:
    """The device a GPU entry point will run on, or a one-line RuntimeError."""
    driver._ensure_init()
    if device_count() == 0:
        raise GpuUnavailableError(f"no CUDA device is visible; megamoe_rt needs {driver.REQUIREMENT}")
    if ordinal is None:
        ordinal = driver.current_device()
    info = device_info(ordinal)
    if not info.is_hopper:
        cc = "{}.{}".format(*info.compute_capability)
        raise GpuUnavailableError(
            f"device {ordinal} ({info.name}) has compute capability {cc}; megamoe_rt kernels need sm_90 (H100/H200)"
        )
    return info
