"""The chunk-ready input ring's device side, as far as the CPU can check it: the ring kernels
and a producer kernel written outside megamoe_rt compile against the producer header with the
options the package hands out, and the header's generation layout is the protocol model's."""

from __future__ import annotations

import io

import pytest

from megamoe_rt.jit.compiler import program_options
from megamoe_rt.kernels import stream as sk
from megamoe_rt.kernels.interface import stream as decl
from megamoe_rt.kernels.registry import all_kernel_specs
from megamoe_rt.schedule import streaming

# What a user's router might do: softmax-free top-1 over 4 experts, one block per chunk.
USER_PRODUCER = r"""
#include "stream/producer.cuh"
using namespace megamoe_rt;

extern "C" __global__ void my_router(stream::StreamRing ring, const float* logits, u32 num_tokens, u32 chunk) {
    __shared__ bool free_slot;
    if (threadIdx.x == 0) free_slot = stream::wait_slot_free(ring, chunk, 10ull * 1000 * 1000 * 1000);
    __syncthreads();
    if (!free_slot) __trap();
    i32* idx = stream::chunk_topk_idx(ring, chunk);
    float* w = stream::chunk_topk_weights(ring, chunk);
    for (u32 t = threadIdx.x; t < ring.tokens_per_slot; t += blockDim.x) {
        const u32 token = chunk * ring.tokens_per_slot + t;
        i32 best = -1;
        float best_logit = -1e30f;
        for (int e = 0; token < num_tokens && e < 4; ++e)
            if (logits[token * 4 + e] > best_logit) best_logit = logits[token * 4 + e], best = e;
        idx[t * ring.num_topk] = best;
        w[t * ring.num_topk] = 1.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) stream::publish_route(ring, stream::producer_epoch(ring), chunk);
}
"""


def test_the_ring_kernels_are_built_with_every_other_kernel():
    names = {s.name for s in all_kernel_specs()}
    assert {s.name for s in sk.kernel_specs()} <= names


@pytest.mark.parametrize("source,experts", [("user", 0), ("reference_router", 16), ("reference_router", 257)])
def test_a_producer_kernel_outside_the_package_compiles_against_the_header(source, experts):
    from megamoe_rt.routers import ROUTER, router_options

    code = USER_PRODUCER if source == "user" else ROUTER
    options = sk.producer_options() if source == "user" else router_options(experts)
    _compile(code, options, "my_router.cu")


def _compile(code: str, options: list[str], name: str) -> str:
    """``code`` built with ``options`` (NVRTC's spellings, as handed out) through cuda.core, as
    megamoe_rt builds its kernels; NVRTC's log. A compile error fails the test with its log."""
    from cuda.core import Program

    log = io.StringIO()
    program = Program(code, "c++", program_options(options, name=name))
    try:
        program.compile("cubin", logs=log)
    finally:
        program.close()
    return log.getvalue()


def test_the_headers_generation_layout_is_the_protocol_models():
    assert decl.EPOCH_SHIFT.value == streaming.EPOCH_SHIFT
    assert streaming.chunk_generation(3, 0) == (3 << decl.EPOCH_SHIFT.value) | 1


def test_a_timed_out_ring_wait_names_the_slot_and_the_generation():
    from megamoe_rt.kernels.interface import sync
    from megamoe_rt.kernels.interface.structs import TimeoutRecord
    from megamoe_rt.runtime.deadlines import describe

    rec = TimeoutRecord(
        state=2,
        site=sync.WAIT_SITE["kStreamRouteReady"],
        rank=1,
        peer=3,
        expected=streaming.chunk_generation(5, 7),
        seen=streaming.chunk_generation(5, 3),
        elapsed_ns=2_000_000_000,
    )
    text = describe(rec)
    assert "wait 'stream route ready' timed out after 2.00 s on rank 1" in text
    assert "input ring slot 3 was never published for generation 0x500000008 (call 5 chunk 7)" in text
    assert text.endswith("it holds 0x500000004; the routing half (topk_idx / topk_weights) is missing")
    rec.site = sync.WAIT_SITE["kStreamLayoutReady"]
    assert describe(rec).endswith("the activation half (x / x_sf) is missing")
    rec.site = sync.WAIT_SITE["kStreamSlotFree"]
    assert "slot 3 was never consumed" in describe(rec)


def test_stream_config_is_checked_and_cuts_calls_into_chunks():
    cfg = streaming.StreamConfig(num_slots=3, tokens_per_slot=100)
    assert cfg.num_chunks(0) == 0 and cfg.num_chunks(250) == 3
    assert [cfg.chunk_tokens(250, c) for c in range(4)] == [100, 100, 50, 0]
    with pytest.raises(ValueError, match="StreamConfig.num_slots=0: expected an integer >= 1"):
        streaming.StreamConfig(0, 100)
    with pytest.raises(TypeError, match="StreamConfig.tokens_per_slot: expected an integer, got float 1.5"):
        streaming.StreamConfig(2, 1.5)


class _AddressesOnly:
    """A layer buffer's addresses (1 << 40 + the region's offset), with no memory behind them."""

    def __init__(self, lay):
        self.lay = lay

    def ptr(self, name):
        try:
            return 1 << 40 | self.lay.region(name).offset
        except ValueError:
            return 1 << 40 | (self.lay.region("workspace").offset + self.lay.workspace_region(name).offset)


def test_the_input_ring_lies_in_the_buffer_and_its_descriptor_points_there():
    from megamoe_rt.kernels.stream import InputRing
    from megamoe_rt.modes.base import LayerSpec, LayoutNeeds, buffer_layout

    spec = LayerSpec(512, 256, 16, 4, 1024, streaming=streaming.StreamConfig(4, 256))
    lay = buffer_layout(spec, LayoutNeeds("full", 128))
    assert (lay.stream_slots, lay.stream_tokens) == (4, 256)
    assert lay.region("stream_x").shape == (1024, 512) and lay.region("stream_topk_idx").shape == (1024, 4)
    assert lay.workspace_region("stream_consumed_gen").shape == (4,)

    ring = InputRing(_AddressesOnly(lay), lay, device=0, timeout_s=None, rank=0)
    d = ring.descriptor
    assert (d.num_slots, d.tokens_per_slot, d.hidden, d.num_topk) == (4, 256, 512, 4)
    assert d.consumer_epoch == d.producer_epoch + 4
    slot2 = ring.slot_addresses(2)
    assert slot2.x == d.x + 2 * 256 * 512 and slot2.topk_idx == d.topk_idx + 2 * 256 * 4 * 4
    assert ring.slot_offsets(2) == (
        lay.region("stream_x").offset + 2 * 256 * 512,
        lay.region("stream_x_sf").offset + 2 * 256 * 4 * 4,
    )
    assert buffer_layout(LayerSpec(512, 256, 16, 4, 1024), LayoutNeeds("full", 128)).stream_slots == 0


def _block_registers(per_thread: int, threads: int) -> int:
    """Registers a block holds: a warp's are allocated in units of 256 (8 a thread)."""
    return -(-per_thread // 8) * 8 * threads


def test_the_consumer_leaves_room_for_four_router_blocks_on_its_sm(tmp_path):
    """The streamed call's consumer sits on every SM beside the producer's blocks: four blocks
    of the reference router (produce_chunks, 256 threads) must fit in the 65536 registers an
    SM has next to a consumer block. At 80 registers for the consumer and 64 for the router only
    two did, and the router ran at about half speed under the consumer."""
    from megamoe_rt.jit import compile_kernel
    from megamoe_rt.jit.cache import CubinCache
    from megamoe_rt.jit.resources import parse_ptxas_report
    from megamoe_rt.kernels.interface.moe import DISPATCH_THREADS
    from megamoe_rt.routers import ROUTER, router_options

    log = _compile(ROUTER, [*router_options(32), "--ptxas-options=-v"], "router.cu")
    router = parse_ptxas_report(log, "produce_chunks", name="produce_chunks")
    (spec,) = [s for s in all_kernel_specs() if s.name == "moe_stream_consume"]
    consumer = compile_kernel(spec, cache=CubinCache(tmp_path / "cache")).resources
    used = _block_registers(consumer.registers, DISPATCH_THREADS.value) + 4 * _block_registers(router.registers, 256)
    assert used <= 65536, (consumer.registers, router.registers)


def test_loading_the_ring_kernels_backs_local_memory_once_with_waits_that_cannot_wait(monkeypatch):
    """The first launch of a kernel with local memory waits for an idle GPU: the ring's waits
    run once when its kernels load, against a scratch ring whose generation words are all ones,
    on a stream of their own, with the capture mode relaxed meanwhile and restored after."""
    from types import SimpleNamespace

    from megamoe_rt.kernels import loader
    from megamoe_rt.kernels.stream import InputRing
    from megamoe_rt.modes.base import LayerSpec, LayoutNeeds, buffer_layout
    from megamoe_rt.runtime import device_memory, driver, streams

    spec = LayerSpec(512, 256, 16, 4, 1024, streaming=streaming.StreamConfig(4, 256))
    lay = buffer_layout(spec, LayoutNeeds("full", 128))

    log = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, block, args, *, stream=None):
            (params,) = args
            log.append(("launch", self.name, grid, block, stream, sk.RingChunkParams.from_buffer_copy(params)))

    class Stream:
        def __init__(self, *, device=None):
            log.append(("stream", device))

        def synchronize(self):
            log.append(("synchronize",))

        def close(self):
            log.append(("close",))

    class Memory:
        ptr = 0xABC000

        def __init__(self, nbytes, *, stream=None):
            assert isinstance(stream, Stream)
            log.append(("alloc", nbytes))

        def memset_u8(self, value, stream=None):
            assert isinstance(stream, Stream)
            log.append(("memset", value))

        def free(self):
            log.append(("free",))

    relaxed, captured = "relaxed", "global"
    cu = SimpleNamespace(
        CUstreamCaptureMode=SimpleNamespace(CU_STREAM_CAPTURE_MODE_RELAXED=relaxed),
        cuThreadExchangeStreamCaptureMode=lambda mode: None,
    )
    mode = [captured]

    def call(fn, *args):
        assert fn is cu.cuThreadExchangeStreamCaptureMode
        log.append(("capture mode", args[0]))
        mode[0], prior = args[0], mode[0]
        return prior

    monkeypatch.setattr(loader, "get_kernel", lambda spec, dev: Kernel(spec.name))
    monkeypatch.setattr(streams, "Stream", Stream)
    monkeypatch.setattr(device_memory, "DeviceMemory", Memory)
    monkeypatch.setattr(driver, "cuda_driver", lambda: cu)
    monkeypatch.setattr(driver, "call", call)
    ring = InputRing(_AddressesOnly(lay), lay, device=3, timeout_s=None, rank=0)
    monkeypatch.setattr(ring, "_resolve_wait", lambda: sk.RingChunkParams().wait)
    ring.load_kernels()
    ring.load_kernels()  # loaded: nothing runs again

    kinds = [e[0] for e in log]
    assert kinds == [
        "capture mode",
        "stream",
        "alloc",
        "memset",
        "launch",
        "launch",
        "free",
        "synchronize",
        "close",
        "capture mode",
    ]
    assert log[0][1] == relaxed and log[-1][1] == captured and mode[0] == captured
    assert log[1] == ("stream", 3) and log[2] == ("alloc", 32) and log[3] == ("memset", 0xFF)
    launches = [e for e in log if e[0] == "launch"]
    assert {e[1] for e in launches} == {"stream_wait_slot_free", "stream_wait_chunk"}
    real = ring.descriptor
    for _, _, grid, block, stream, params in launches:
        assert (grid, block, params.chunk) == ((1,), (32,), 0) and isinstance(stream, Stream)
        r = params.ring
        assert (r.route_ready_gen, r.layout_ready_gen, r.consumed_gen) == (Memory.ptr, Memory.ptr + 8, Memory.ptr + 16)
        assert r.producer_epoch == r.consumer_epoch == Memory.ptr + 24 and r.num_slots == 1
        assert (r.x, r.topk_idx, r.tokens_per_slot, r.hidden) == (real.x, real.topk_idx, 256, 512)
    # The kernels that launch it are the ones with a local-memory frame.
    assert {e[1] for e in launches} == set(sk._LOCAL_MEMORY_WAITS)
