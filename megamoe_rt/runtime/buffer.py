"""The per-rank MoE buffer: one allocation carved into the regions of layout.py.

One rank uses plain device memory (:class:`DeviceBuffer`, CuPy's allocator); across ranks the
same regions live on the NVSHMEM symmetric heap (:class:`megamoe_rt.ep.symm.SymmetricBuffer`).
Both share this interface: region addresses, typed CuPy views, and (symmetric only) the
address of a region in a peer rank's buffer. :class:`LayerBuffer` and
:class:`SymmetricLayerBuffer` say so as protocols, for annotations.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol, runtime_checkable

from megamoe_rt.runtime.arrays import require_cupy
from megamoe_rt.schedule.layout import BufferLayout, Region

_CUPY_DTYPES = {
    "e4m3": "uint8",
    "uint8": "uint8",
    "bf16": "uint16",
    "float32": "float32",
    "int32": "int32",
    "uint32": "uint32",
    "uint64": "uint64",
}


@runtime_checkable
class LayerBuffer(Protocol):
    """The per-rank MoE buffer as the layer and its modes use it (:class:`DeviceBuffer`,
    :class:`megamoe_rt.ep.symm.SymmetricBuffer`)."""

    layout: BufferLayout
    device: int
    base_ptr: int

    def ptr(self, name: str) -> int:
        """Device address of region ``name``."""
        ...

    def view(self, name: str) -> Any:
        """A CuPy array over region ``name``, typed and shaped as the layout says."""
        ...

    def close(self) -> None:
        """Give the memory back (work still using it must have finished)."""
        ...


@runtime_checkable
class SymmetricLayerBuffer(LayerBuffer, Protocol):
    """A :class:`LayerBuffer` that every rank holds at the same layout, with its peers'
    copies addressable by load/store; freeing it is collective."""

    rank: int
    peer_base_ptrs: list[int]

    def peer_ptr(self, rank: int, name: str) -> int: ...

    def peer_view(self, rank: int, name: str) -> Any: ...

    def peer_table(self) -> ctypes.Array[ctypes.c_uint64]: ...


def typed_view(raw: Any, region: Region) -> Any:
    """A CuPy uint8 array over a region's bytes, viewed with the region's dtype and shape."""
    cupy = require_cupy()
    return raw.view(cupy.dtype(_CUPY_DTYPES[region.dtype])).reshape(region.shape)


class LaidOutBuffer:
    """Regions of a :class:`BufferLayout` over one allocation at ``base_ptr``."""

    layout: BufferLayout
    device: int
    base_ptr: int

    def _locate(self, name: str) -> tuple[Region, int]:
        if any(r.name == name for r in self.layout.regions):
            region = self.layout.region(name)
            return region, region.offset
        region = self.layout.workspace_region(name)  # raises ValueError naming the choices
        return region, self.layout.region("workspace").offset + region.offset

    def ptr(self, name: str) -> int:
        """Device address of a region (top level or workspace)."""
        return self.base_ptr + self._locate(name)[1]

    def _bytes(self, offset: int, nbytes: int) -> Any:
        """A CuPy uint8 array over ``[offset, offset + nbytes)`` of the allocation."""
        raise NotImplementedError

    def view(self, name: str) -> Any:
        """A CuPy array over a region, typed and shaped as the layout says."""
        region, offset = self._locate(name)
        return typed_view(self._bytes(offset, region.nbytes), region)

    def memory_report(self) -> list[tuple[str, int, float]]:
        return self.layout.report()


class DeviceBuffer(LaidOutBuffer):
    """Plain device memory laid out by a :class:`BufferLayout` (single rank)."""

    def __init__(self, layout: BufferLayout, *, device: int):
        cupy = require_cupy()
        self.layout = layout
        self.device = device
        with cupy.cuda.Device(device):
            self._mem: Any = cupy.empty(layout.total_bytes, dtype=cupy.uint8)
        self.base_ptr = int(self._mem.data.ptr)

    def _bytes(self, offset: int, nbytes: int) -> Any:
        if self._mem is None:
            raise RuntimeError("DeviceBuffer: the buffer was closed")
        return self._mem[offset : offset + nbytes]

    def close(self) -> None:
        """Hand the allocation back to CuPy's pool; views taken earlier keep it alive."""
        self._mem = None
