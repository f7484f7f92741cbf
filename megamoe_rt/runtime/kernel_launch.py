"""Kernels loaded from cubins as CUlibraries, and their launches: plain, or through
``cuLaunchKernelEx`` with cluster, cooperative or programmatic-dependent-launch attributes.
Launch arguments go by value as ctypes structs in parameter order, which cuda.core's launch
does not take (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from megamoe_rt.runtime import driver
from megamoe_rt.runtime.streams import stream_handle

# Configurations one kernel keeps (each names a stream: a caller cycling through many streams
# starts over rather than growing the table).
_MAX_CACHED_CONFIGS = 64


def _launch_config(
    grid: Sequence[int],
    block: Sequence[int],
    smem: int,
    stream: int,
    *,
    cluster: Sequence[int] | None = None,
    cooperative: bool = False,
    programmatic: bool = False,
) -> Any:
    cu = driver.cuda_driver()
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.hStream = cu.CUstream(stream)
    attrs = []
    if cluster is not None:
        c = tuple(cluster) + (1,) * (3 - len(cluster))
        if any(gi % ci for gi, ci in zip(grid, c)):
            raise ValueError(f"grid {tuple(grid)} is not a multiple of the cluster shape {c}")
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = c
        attrs.append(attr)
    if cooperative:
        # All blocks resident at once (or the launch fails): grid-wide barriers rely on it.
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    if programmatic:
        # Programmatic dependent launch: the kernel may start before the previous kernel in the
        # stream has finished; it waits for it with griddepcontrol.wait before using its results.
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


class LoadedKernel:
    """A kernel from a cubin loaded as a CUlibrary.

    Keeps both the context-independent ``CUkernel`` (green-context graph nodes
    take it) and the ``CUfunction`` for the current context (plain launches).
    """

    def __init__(self, cubin: bytes, lowered_name: str, *, dynamic_smem_bytes: int = 0):
        driver.ensure_context()
        cu = driver.cuda_driver()
        self.lowered_name = lowered_name
        self.library = driver.call(cu.cuLibraryLoadData, cubin, None, None, 0, None, None, 0)
        self.kernel = driver.call(cu.cuLibraryGetKernel, self.library, lowered_name.encode())
        self.function = driver.call(cu.cuKernelGetFunction, self.kernel)
        self.dynamic_smem_bytes = int(dynamic_smem_bytes)
        # Launch configurations by their fields: a layer's launches repeat a few shapes on a few
        # streams, and building one (the driver's config and attribute objects) costs more host
        # time than the launch itself.
        self._configs: dict[tuple[Any, ...], Any] = {}
        if self.dynamic_smem_bytes > 48 * 1024:
            driver.call(
                cu.cuFuncSetAttribute,
                self.function,
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.dynamic_smem_bytes,
            )

    def prefer_max_shared_memory(self) -> None:
        """Ask for the SM configuration with the most shared memory whenever this kernel runs.

        A kernel using little shared memory otherwise lets the driver shrink the shared
        memory of the SMs it runs on, and a block of another kernel that needs more cannot join
        them until they drain: a kernel whose blocks wait for such a kernel's work (a streamed
        call's consumer, waiting on the producer's kernels) must not do that to every SM."""
        cu = driver.cuda_driver()
        driver.call(
            cu.cuFuncSetAttribute,
            self.function,
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            int(cu.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED),
        )

    def attribute(self, name: str) -> int:
        cu = driver.cuda_driver()
        attr = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name.upper()}")
        return int(driver.call(cu.cuFuncGetAttribute, attr, self.function))

    def launch(
        self,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[ctypes._SimpleCData[Any] | ctypes.Structure],
        *,
        stream: Any = None,
        smem_bytes: int | None = None,
        cluster: Sequence[int] | None = None,
        in_stream_context: bool = False,
        cooperative: bool = False,
        programmatic: bool = False,
    ) -> None:
        """Launch with ``args`` given as ctypes objects in parameter order.

        ``cluster``: thread-block-cluster shape; the grid must be a multiple of it.
        ``in_stream_context``: launch the context-independent ``CUkernel`` so it runs in the
        stream's own context (a green context's stream keeps it inside that partition).
        ``cooperative``: every block is resident at once, or the launch fails (grid barriers).
        ``programmatic``: programmatic dependent launch (the kernel must griddepcontrol.wait).
        """
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if min(g) <= 0 or min(b) <= 0:
            raise ValueError(f"grid {g} and block {b} must be positive")
        ptrs = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(a) for a in args])
        smem = self.dynamic_smem_bytes if smem_bytes is None else smem_bytes
        cu = driver.cuda_driver()
        func = cu.CUfunction(int(self.kernel)) if in_stream_context else self.function
        if cluster is not None and tuple(cluster) in ((1,), (1, 1, 1)):
            cluster = None
        if cluster is None and not cooperative and not programmatic:
            driver.call(cu.cuLaunchKernel, func, *g, *b, smem, stream_handle(stream), ctypes.addressof(ptrs), 0)
            return
        key = (
            g,
            b,
            smem,
            stream_handle(stream),
            None if cluster is None else tuple(cluster),
            cooperative,
            programmatic,
        )
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= _MAX_CACHED_CONFIGS:
                self._configs.clear()
            cfg = self._configs[key] = _launch_config(
                g, b, smem, key[3], cluster=cluster, cooperative=cooperative, programmatic=programmatic
            )
        driver.call(cu.cuLaunchKernelEx, cfg, func, ctypes.addressof(ptrs), 0)

    def max_active_clusters(self, block: Sequence[int], cluster: Sequence[int], smem_bytes: int | None = None) -> int:
        """How many clusters of this shape can be resident at once (persistent grids size by it).

        Not every SM can host a cluster member (GPCs with an odd SM count leave one out),
        so a persistent grid of sm_count / cluster_size clusters may not fit in one wave.
        """
        key = (tuple(block), tuple(cluster), smem_bytes)
        cache: dict[tuple[tuple[int, ...], tuple[int, ...], int | None], int] = self.__dict__.setdefault(
            "_cluster_occupancy", {}
        )
        if key not in cache:
            smem = self.dynamic_smem_bytes if smem_bytes is None else smem_bytes
            b = tuple(block) + (1,) * (3 - len(block))
            c = tuple(cluster) + (1,) * (3 - len(cluster))
            cfg = _launch_config(c, b, smem, 0, cluster=c)
            cache[key] = int(driver.call(driver.cuda_driver().cuOccupancyMaxActiveClusters, self.function, cfg))
        return cache[key]

    def max_active_blocks_per_sm(self, block_threads: int, smem_bytes: int | None = None) -> int:
        smem = self.dynamic_smem_bytes if smem_bytes is None else smem_bytes
        return int(
            driver.call(
                driver.cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor, self.function, block_threads, smem
            )
        )

    def __del__(self) -> None:
        try:
            if getattr(self, "library", None) is not None:
                driver.cuda_driver().cuLibraryUnload(self.library)
        except Exception:
            pass
