"""Kernels of the chunk-ready input ring (cuda_src/stream/chunk_ring.cu), and what a producer
kernel outside megamoe_rt needs to include the ring's producer header
(cuda_src/stream/producer.cuh)."""

from __future__ import annotations

from megamoe_rt.jit import KernelSpec, cuda_src_dir
from megamoe_rt.jit.compiler import ARCH, CXX_STD
from megamoe_rt.kernels.interface.structs import RingChunkParams as RingChunkParams
from megamoe_rt.kernels.interface.structs import StreamRing as StreamRing

SOURCE = "stream/chunk_ring.cu"
PRODUCER_HEADER = "stream/producer.cuh"
COPY_THREADS = 256  # kCopyThreads in chunk_ring.cu

# (entry, threads): the writer's four, then the layer's three. Every one takes RingChunkParams.
_KERNELS = (
    ("stream_begin_call", 32),
    ("stream_wait_slot_free", 32),
    ("stream_copy_chunk", COPY_THREADS),
    ("stream_publish_chunk", 32),
    ("stream_begin_consume", 32),
    ("stream_wait_chunk", 32),
    ("stream_release_chunk", 32),
)


def _spec(entry: str, threads: int) -> KernelSpec:
    # The waits print their report (no wgmma here).
    return KernelSpec(
        name=entry,
        source=SOURCE,
        entry=f"megamoe_rt::stream::{entry}",
        block_threads=threads,
        uses_printf="wait" in entry,
        params=(RingChunkParams,),
    )


def kernel_specs() -> list[KernelSpec]:
    return [_spec(entry, threads) for entry, threads in _KERNELS]


def producer_options() -> list[str]:
    """NVRTC options for a producer kernel that includes ``"stream/producer.cuh"`` (CuPy:
    ``cupy.RawKernel(code, name, options=tuple(producer_options()))``): the include path of
    megamoe_rt's device tree, the language level and the architecture it was written for."""
    return [f"-I{cuda_src_dir()}", f"--std={CXX_STD}", f"--gpu-architecture={ARCH}"]
