"""Kernels of the chunk-ready input ring (cuda_src/stream/chunk_ring.cu), and what a producer
kernel outside megamoe_rt needs to include the ring's producer header
(cuda_src/stream/producer.cuh)."""

from __future__ import annotations

from typing import Any, NamedTuple

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

# The kernels with a local-memory frame (their report's printf): see InputRing._back_local_memory.
_LOCAL_MEMORY_WAITS = ("stream_wait_slot_free", "stream_wait_chunk")


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


class SlotAddresses(NamedTuple):
    """Device addresses of one slot's payload (token t of the chunk is row t of each)."""

    x: int
    x_sf: int
    topk_idx: int
    topk_weights: int


class InputRing:
    """A layer's chunk-ready input ring in its buffer: the descriptor producers get, the slot
    addresses the layer reads, and the ring's kernels, producer side (for a host-side writer)
    and consumer side (the layer's waits and releases)."""

    def __init__(self, buffer: Any, layout: Any, *, device: int, timeout_s: float | None, rank: int):
        if not layout.stream_slots:
            raise ValueError("the buffer has no input ring (a layer built without streaming=StreamConfig(...))")
        self.layout, self.device, self.timeout_s, self.rank = layout, device, timeout_s, rank
        # Host-side bookkeeping of calls for check_producer: calls begun by producers and by the
        # layer, the last eager streamed call's stream and an event after it, and the call it
        # waits on a producer for (None: its producer came first).
        self._producer_calls = self._consumer_calls = 0
        self._consumer_stream: Any = None  # a streams.StreamOrder
        self._consumer_done: Any = None
        self._awaited_call: int | None = None
        self._untracked = False
        self.num_slots, self.tokens_per_slot = layout.stream_slots, layout.stream_tokens
        epochs = buffer.ptr("stream_epochs")
        self.descriptor = StreamRing(
            x=buffer.ptr("stream_x"),
            x_sf=buffer.ptr("stream_x_sf"),
            topk_idx=buffer.ptr("stream_topk_idx"),
            topk_weights=buffer.ptr("stream_topk_weights"),
            route_ready_gen=buffer.ptr("stream_route_ready_gen"),
            layout_ready_gen=buffer.ptr("stream_layout_ready_gen"),
            consumed_gen=buffer.ptr("stream_consumed_gen"),
            producer_epoch=epochs,
            consumer_epoch=epochs + 4,
            num_slots=self.num_slots,
            tokens_per_slot=self.tokens_per_slot,
            hidden=layout.hidden,
            num_topk=layout.num_topk,
        )
        self._kernels: dict[str, Any] = {}
        self._wait: Any = None  # the current call's WaitContext (see params)

    # --- where a slot is ---

    def slot_addresses(self, slot: int) -> SlotAddresses:
        d, c, h, k = self.descriptor, self.tokens_per_slot, self.layout.hidden, self.layout.num_topk
        first = slot * c
        return SlotAddresses(
            d.x + first * h, d.x_sf + first * (h // 128) * 4, d.topk_idx + first * k * 4, d.topk_weights + first * k * 4
        )

    def slot_offsets(self, slot: int) -> tuple[int, int]:
        """Byte offsets in the buffer of the slot's x and x_sf (the same on every rank: peers pull
        a chunk's rows from there)."""
        first = slot * self.tokens_per_slot
        h = self.layout.hidden
        return (
            self.layout.region("stream_x").offset + first * h,
            self.layout.region("stream_x_sf").offset + first * (h // 128) * 4,
        )

    # --- kernels ---

    def load_kernels(self) -> None:
        """Compile and load every ring kernel now (across ranks: before any deadline runs)."""
        if len(self._kernels) == len(_KERNELS):
            return  # launched per chunk: no spec list rebuilt once all are loaded
        from megamoe_rt.kernels.loader import get_kernel

        for spec in kernel_specs():
            if spec.name not in self._kernels:
                self._kernels[spec.name] = get_kernel(spec, self.device)
        self._back_local_memory()

    def _back_local_memory(self) -> None:
        """Launch the ring's waits once, on a stream of their own, and wait for them.

        CUDA backs a context's local memory when the first kernel that needs some is launched,
        and that launch waits for the GPU to go idle. The waits need some (their deadline
        report's printf); the fused kernel's streamed call needs none. Were a writer's first
        wait launched while that call already spins on a chunk, the writer would hold until the
        deadline. Here the ring is a scratch one whose generation words are all ones, so neither
        wait waits; the capture mode is relaxed meanwhile, as a first call may be captured."""
        from megamoe_rt.runtime import driver, streams
        from megamoe_rt.runtime.device_memory import DeviceMemory

        cu = driver.cuda_driver()
        mode = driver.call(cu.cuThreadExchangeStreamCaptureMode, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        try:
            stream = streams.Stream(device=self.device)
            words = DeviceMemory(32, stream=stream)  # route, layout, consumed generation; epochs
            words.memset_u8(0xFF, stream)
            ring = StreamRing.from_buffer_copy(self.descriptor)
            ring.route_ready_gen, ring.layout_ready_gen, ring.consumed_gen = words.ptr, words.ptr + 8, words.ptr + 16
            ring.producer_epoch = ring.consumer_epoch = words.ptr + 24
            ring.num_slots = 1
            params = RingChunkParams(ring=ring, wait=self._resolve_wait(), chunk=0)
            for name in _LOCAL_MEMORY_WAITS:
                self._kernels[name].launch((1,), (32,), [params], stream=stream)
            words.free()
            stream.synchronize()
            stream.close()
        finally:
            driver.call(cu.cuThreadExchangeStreamCaptureMode, mode)

    def params(self, chunk: int = 0, **inputs: Any) -> RingChunkParams:
        if self._wait is None:
            self._wait = self._resolve_wait()
        return RingChunkParams(ring=self.descriptor, wait=self._wait, chunk=chunk, **inputs)

    def _resolve_wait(self) -> Any:
        """The waits' deadline context, resolved at the first launch of a call (on either side)
        and reused by its chunks: reading the deadline from the environment per chunk costs host
        time on the path that feeds the GPU."""
        from megamoe_rt.runtime.deadlines import TimeoutRecord

        return TimeoutRecord.get().context(self.timeout_s, rank=self.rank)

    def _launch(self, name: str, params: RingChunkParams, stream: int, grid: int = 1) -> None:
        self.load_kernels()
        threads = COPY_THREADS if name == "stream_copy_chunk" else 32
        self._kernels[name].launch((grid,), (threads,), [params], stream=stream)

    def begin_consume(self, stream: int) -> None:
        self._wait = None  # resolved again for this call
        self._launch("stream_begin_consume", self.params(), stream)

    def note_consumer(self, stream: int) -> None:
        """A streamed call was just enqueued on ``stream`` (eagerly): remember it with an event
        after it, and whether its producer's call is still to come, so that a host-side
        producer that could only run after it is refused (:meth:`check_producer`)."""
        from megamoe_rt.runtime import streams

        self._consumer_calls += 1
        if self._untracked or streams.stream_is_capturing(stream):
            # Graph replays advance the ring without the host: from now on the host's counts
            # are not the ring's, so no check is made (never a false refusal).
            self._untracked = True
            return
        if self._consumer_done is None:
            self._consumer_done = streams.Event(device=self.device, timing=False)
        self._consumer_done.record(stream)
        self._consumer_stream = streams.StreamOrder.of(stream)
        self._awaited_call = self._consumer_calls if self._producer_calls < self._consumer_calls else None

    def check_producer(self, stream: int, *, new_call: bool = False) -> None:
        """Refuse producer work on ``stream`` (``new_call``: its ``begin_call``) that the pending
        streamed call waits for but that could only run after that call: both would hold until
        the deadline trap."""
        from megamoe_rt.runtime import streams

        if self._untracked:
            return
        if streams.stream_is_capturing(stream):
            # Captured producer work runs wherever the graph is launched, not here; and its
            # replays move the ring without the host: stand down for good.
            self._untracked = True
            return
        if self._awaited_call is None or self._consumer_stream is None:
            return
        call = self._producer_calls + (1 if new_call else 0)
        if call > self._awaited_call or self._consumer_done.done:
            return
        consumer = self._consumer_stream
        if consumer.serialises_with(streams.StreamOrder.of(stream)):
            raise ValueError(
                f"stream: a producer on stream {stream:#x} runs only after the layer's streamed call on stream "
                f"{consumer.handle:#x} ({consumer.kind.replace('_', '-')}), which waits for its chunks (deadlock); "
                "produce on a stream that does not wait for that one (a non-blocking stream), or before the call "
                "(docs/STREAMING.md, 'Progress')"
            )

    def wait_chunk(self, chunk: int, stream: int) -> None:
        self._launch("stream_wait_chunk", self.params(chunk), stream)

    def release_chunk(self, chunk: int, stream: int) -> None:
        self._launch("stream_release_chunk", self.params(chunk), stream)

    def begin_call(self, stream: int) -> None:
        """Producer side: a new call's chunks follow (their generations carry its epoch). The
        check also notes a capture (the guard then stands down)."""
        self.check_producer(stream, new_call=True)
        self._wait = None  # resolved again for this call
        self._launch("stream_begin_call", self.params(), stream)
        self._producer_calls += 1

    def write_chunk(self, chunk: int, inputs: dict[str, int], num_tokens: int, sm_count: int, stream: int) -> None:
        """Producer side: wait for the chunk's slot, copy the call's tokens of the chunk into it
        (``inputs``: device addresses of x, x_sf, topk_idx, topk_weights, and ``topk_idx_bytes``,
        4 or 8), publish it."""
        params = self.params(chunk, num_tokens=num_tokens, **inputs)
        self._launch("stream_wait_slot_free", params, stream)
        grid = max(1, min(-(-self.tokens_per_slot // (COPY_THREADS // 32)), sm_count * 4))
        self._launch("stream_copy_chunk", params, stream, grid)
        self._launch("stream_publish_chunk", params, stream)
