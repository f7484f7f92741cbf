"""The per-rank MoE buffer: one allocation carved into the regions of layout.py.

One rank uses plain device memory (CuPy's allocator); the NVSHMEM symmetric heap
is another backing of the same interface (offsets, typed views, peer pointers).
"""

from __future__ import annotations

from typing import Any

from .arrays import require_cupy
from .layout import BufferLayout

_CUPY_DTYPES = {"e4m3": "uint8", "uint8": "uint8", "bf16": "uint16", "float32": "float32", "int32": "int32",
                "uint32": "uint32", "uint64": "uint64"}


class DeviceBuffer:
    """Plain device memory laid out by a :class:`BufferLayout` (single rank)."""

    def __init__(self, layout: BufferLayout, *, device: int):
        cupy = require_cupy()
        self.layout = layout
        self.device = device
        with cupy.cuda.Device(device):
            self._mem = cupy.empty(layout.total_bytes, dtype=cupy.uint8)
        self.base_ptr = int(self._mem.data.ptr)
        ws = layout.region("workspace")
        self._workspace_offset = ws.offset

    def _locate(self, name: str):
        if any(r.name == name for r in self.layout.regions):
            region = self.layout.region(name)
            return region, region.offset
        region = self.layout.workspace_region(name)  # raises ValueError naming the choices
        return region, self._workspace_offset + region.offset

    def ptr(self, name: str) -> int:
        """Device address of a region (top level or workspace)."""
        return self.base_ptr + self._locate(name)[1]

    def view(self, name: str) -> Any:
        """A CuPy array over a region, typed and shaped as the layout says."""
        region, offset = self._locate(name)
        cupy = require_cupy()
        raw = self._mem[offset:offset + region.nbytes]
        return raw.view(cupy.dtype(_CUPY_DTYPES[region.dtype])).reshape(region.shape)

    def memory_report(self) -> list[tuple[str, int, float]]:
        return self.layout.report()
