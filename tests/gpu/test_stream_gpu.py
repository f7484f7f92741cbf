"""Streamed calls on one GPU: a producer writes a call's chunks into the layer's input ring on
its own stream while the layer consumes them on another. The output must be the batch call's,
bit for bit, whatever the ring size, the timing of the producer or the number of replays."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.layer_calls import BF16_NAN, device_args, run_poisoned
from tests.helpers.traps import SYNC_AND_REPORT

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

H, I, E, K, CAP = 512, 256, 16, 4, 2048
# The modes that consume the ring on one rank: the fused kernel's streamed role (the default)
# and the unfused call-wide pool.
MODES = ["fused", "unfused"]


def _layers(w, slots, tokens_per_slot, mode=None, **kw):
    from megamoe_rt import MegaMoE
    from megamoe_rt.streaming import StreamConfig

    streamed = MegaMoE(H, I, E, K, CAP, streaming=StreamConfig(slots, tokens_per_slot), mode=mode, **kw)
    batch = MegaMoE(H, I, E, K, CAP, mode="unfused")
    for layer in (streamed, batch):
        layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
    cp.cuda.Device().synchronize()
    return streamed, batch


def _streamed(layer, args, *, producer_delay_s=0.0):
    """The layer consumes on one stream while a ChunkWriter produces on another."""
    from megamoe_rt.streaming import ChunkWriter

    t = args[0].shape[0]
    producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    cp.cuda.get_current_stream().synchronize()  # the inputs
    writer = ChunkWriter(layer)
    out = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
    layer.consume(t, out=out, stream=consumer)  # waits on the device for chunks not yet written
    if producer_delay_s:
        time.sleep(producer_delay_s)
    writer.write_all(*args, stream=producer)
    consumer.synchronize()
    producer.synchronize()
    return cp.asnumpy(out)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("slots,tokens_per_slot,t", [(2, 128, 1000), (4, 256, 256), (3, 100, 250), (1, 512, 2048)])
def test_streamed_equals_batch_bitwise(slots, tokens_per_slot, t, mode):
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, H, I, E, K)
    streamed, batch = _layers(w, slots, tokens_per_slot, mode)
    for _ in range(2):  # a second call: new epoch over the same ring
        args = device_args(ref.random_moe_inputs(rng, t, H, I, E, K, empty_slot_prob=0.05))
        np.testing.assert_array_equal(_streamed(streamed, args), run_poisoned(batch, args))


def test_a_small_layer_whose_streamed_order_runs_past_its_pool_equals_batch():
    """Few blocks and a lag of many positions: before the seal the fused kernel's open order
    points at ready-list positions past the whole pool, which must read as "not yet" (then "never"
    at the seal), not as whatever words follow the list."""
    from megamoe_rt import MegaMoE
    from megamoe_rt.streaming import StreamConfig

    rng = np.random.default_rng()
    e, k, cap = 8, 2, 128
    w = ref.random_moe_inputs(rng, 1, H, I, e, k)
    streamed = MegaMoE(H, I, e, k, cap, streaming=StreamConfig(2, 32), mode="fused")
    batch = MegaMoE(H, I, e, k, cap, mode="unfused")
    for layer in (streamed, batch):
        layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
    assert streamed.runner.streamed.lag > streamed.layout.full_pool_blocks
    for t in (cap, 77, 1):
        args = device_args(ref.random_moe_inputs(rng, t, H, I, e, k, empty_slot_prob=0.05))
        np.testing.assert_array_equal(_streamed(streamed, args), run_poisoned(batch, args))


@pytest.mark.parametrize("mode,ring_blocks", [("fused", None), ("unfused", None), ("unfused", 4)])
def test_skewed_routing_streamed_equals_batch_bitwise(mode, ring_blocks):
    """Most tokens route to the same few experts, so one expert's rows fill many pool blocks,
    claimed chunk after chunk between other experts' blocks (the call-wide pool; in the fused
    kernel the hot experts' full blocks reach L1 while later chunks arrive); with a ring pool
    (``ring_blocks``) every chunk runs as a call of its own."""
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, H, I, E, K)
    streamed, batch = _layers(w, 2, 200, mode, ring_blocks=ring_blocks)
    t = 1500
    inputs = ref.random_moe_inputs(rng, t, H, I, E, K)
    idx = inputs["topk_idx"]
    idx[rng.random(t) < 0.7] = rng.permutation(K).astype(idx.dtype)  # the hot experts 0..K-1
    idx[rng.random(idx.shape) < 0.05] = -1
    args = device_args(inputs)
    np.testing.assert_array_equal(_streamed(streamed, args), run_poisoned(batch, args))


@pytest.mark.parametrize("mode", MODES)
def test_a_late_producer_and_an_empty_call_stay_correct(mode):
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, H, I, E, K)
    streamed, batch = _layers(w, 2, 128, mode)
    args = device_args(ref.random_moe_inputs(rng, 700, H, I, E, K))
    np.testing.assert_array_equal(_streamed(streamed, args, producer_delay_s=0.2), run_poisoned(batch, args))
    empty = [a[:0] for a in args]
    assert _streamed(streamed, empty).shape == (0, H)
    args = device_args(ref.random_moe_inputs(rng, 300, H, I, E, K))  # and the ring still works after it
    np.testing.assert_array_equal(_streamed(streamed, args), run_poisoned(batch, args))


@pytest.mark.parametrize("mode", MODES)
def test_twenty_graph_replays_of_producer_and_consumer(mode):
    from megamoe_rt.streaming import ChunkWriter

    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, H, I, E, K)
    streamed, batch = _layers(w, 3, 128, mode)
    t = 900
    args = device_args(ref.random_moe_inputs(rng, t, H, I, E, K))
    writer = ChunkWriter(streamed)
    producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    out = cp.empty((t, H), dtype=cp.uint16)
    _streamed(streamed, args)  # warm: kernels loaded outside the captures
    with producer:
        producer.begin_capture()
        writer.write_all(*args, stream=producer)
        produce = producer.end_capture()
    with consumer:
        consumer.begin_capture()
        streamed.consume(t, out=out, stream=consumer)
        consume = consumer.end_capture()
    for _ in range(20):
        fresh = device_args(ref.random_moe_inputs(rng, t, H, I, E, K))
        for dst, src in zip(args, fresh, strict=True):
            dst[...] = src
        cp.cuda.get_current_stream().synchronize()
        out.fill(BF16_NAN)
        cp.cuda.get_current_stream().synchronize()
        consume.launch(stream=consumer)
        produce.launch(stream=producer)
        consumer.synchronize()
        producer.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), run_poisoned(batch, args))


@pytest.mark.parametrize("mode", MODES)
def test_a_chunk_never_published_traps_naming_the_slot_and_generation(mode):
    script = (
        textwrap.dedent(f"""
        import sys
        import cupy as cp
        from megamoe_rt import MegaMoE
        from megamoe_rt import reference as ref
        from megamoe_rt.runtime import driver
        from megamoe_rt.streaming import StreamConfig
        from cuda.bindings import driver as cu
        w = ref.random_moe_inputs(0, 1, {H}, {I}, {E}, {K})
        layer = MegaMoE({H}, {I}, {E}, {K}, 256, streaming=StreamConfig(2, 128), mode={mode!r}, timeout_s=1.0)
        layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
        layer.consume(200)  # nobody produces
    """)
        + SYNC_AND_REPORT
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    # The two chunks are waited for at once (a group of blocks each): the report names whichever
    # wait timed out first, with its own slot and generation.
    named = re.search(
        r"input ring slot (\d) was never published for generation 0x10000000(\d) \(call 1 chunk (\d)\)", text
    )
    assert named is not None, text
    slot, gen, chunk = (int(g) for g in named.groups())
    assert chunk in (0, 1) and slot == chunk and gen == chunk + 1, text
    assert "wait 'stream route ready'" in text and "the routing half (topk_idx / topk_weights) is missing" in text


ROUTE_HALF_ONLY = r"""
#include "stream/producer.cuh"
using namespace megamoe_rt;
extern "C" __global__ void route_half_only(const stream::StreamRing* ring_ptr) {
    const stream::StreamRing ring = *ring_ptr;
    stream::publish_route(ring, stream::producer_epoch(ring), blockIdx.x);
}
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_chunk_with_only_its_routing_half_published_traps_naming_the_missing_half(mode):
    """A producer of one's own publishes each chunk's routing half and never its activations:
    the layer's report must say which half of which chunk never came."""
    script = (
        textwrap.dedent(f"""
        import sys
        import numpy as np
        import cupy as cp
        from megamoe_rt import MegaMoE
        from megamoe_rt import reference as ref
        from megamoe_rt.kernels.stream import producer_options
        from megamoe_rt.runtime import driver
        from megamoe_rt.streaming import ChunkWriter, StreamConfig
        from cuda.bindings import driver as cu
        w = ref.random_moe_inputs(0, 1, {H}, {I}, {E}, {K})
        layer = MegaMoE({H}, {I}, {E}, {K}, 256, streaming=StreamConfig(2, 128), mode={mode!r}, timeout_s=1.0)
        layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
        source = {ROUTE_HALF_ONLY!r}
        kernel = cp.RawModule(code=source, options=tuple(producer_options())).get_function("route_half_only")
        ring = cp.asarray(np.frombuffer(bytes(layer.input_ring.descriptor), dtype=np.uint8))
        producer = cp.cuda.Stream(non_blocking=True)
        ChunkWriter(layer).begin_call(stream=producer)
        with producer:
            kernel((2,), (32,), (ring,))  # both chunks' routing, no activations
        producer.synchronize()
        layer.consume(200)
    """)
        + SYNC_AND_REPORT
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    named = re.search(r"input ring slot (\d) was never published for generation 0x10000000(\d)", text)
    assert named is not None, text
    slot, gen = (int(g) for g in named.groups())
    assert slot in (0, 1) and gen == slot + 1, text
    assert "wait 'stream layout ready'" in text and "the activation half (x / x_sf) is missing" in text, text


def test_a_writer_behind_the_call_it_feeds_is_refused_and_the_call_still_completes():
    """ChunkWriter on the consumer's own stream would wait behind the call that waits for it:
    refused before it launches anything; the same writer on another stream then completes the
    call, bit for bit."""
    from megamoe_rt.streaming import ChunkWriter

    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, H, I, E, K)
    streamed, batch = _layers(w, 2, 128)
    t = 300
    args = device_args(ref.random_moe_inputs(rng, t, H, I, E, K))
    cp.cuda.get_current_stream().synchronize()
    writer = ChunkWriter(streamed)
    consumer, producer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    out = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
    streamed.consume(t, out=out, stream=consumer)
    with pytest.raises(ValueError, match="deadlock"):
        writer.write_all(*args, stream=consumer)
    writer.write_all(*args, stream=producer)
    consumer.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), run_poisoned(batch, args))


@pytest.mark.parametrize("mode", MODES)
def test_int64_ids_stream_like_the_batch_call(mode):
    """A framework's top-k gives int64 ids: the writer narrows them into the slot's int32, and
    an id out of range is refused and reported as the batch call refuses it."""
    from megamoe_rt.runtime.error_report import DeviceInputError

    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, H, I, E, K)
    streamed, batch = _layers(w, 2, 96, mode)
    inputs = ref.random_moe_inputs(rng, 300, H, I, E, K, empty_slot_prob=0.1)
    inputs["topk_idx"] = inputs["topk_idx"].astype(np.int64)
    args = device_args(inputs)
    np.testing.assert_array_equal(_streamed(streamed, args), run_poisoned(batch, args))
    args[2][7, 1] = 1 << 40  # outside int32 as well as outside [-1, E)
    got, want = _streamed(streamed, args), run_poisoned(batch, args)
    np.testing.assert_array_equal(got, want)
    for layer in (streamed, batch):
        with pytest.raises(DeviceInputError, match=r"topk_idx\[7, 1\] = 2147483647"):
            layer.synchronize()
