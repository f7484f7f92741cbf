"""A router that streams a layer call's inputs: CuPy kernels compute each chunk's gating
product, route it (softmax over the experts, top-k) and quantize its activations straight into
the layer's input ring, one launch per round of the ring, publishing each chunk as soon as it is
done, on a producer stream, while the layer consumes the chunks already published on its own
stream. The result is checked against the
same call made the usual way (all tokens routed first, then the layer). Run on a Hopper GPU:

    python examples/streaming_router.py [--tokens 4096] [--slots 4] [--chunk 512]
"""

import argparse

from megamoe_rt import MegaMoE, Router, StreamConfig, quantize_fp8, quantize_weight_fp8, require_gpu

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--slots", type=int, default=4)
ap.add_argument("--chunk", type=int, default=512)
a = ap.parse_args()

# Before CuPy is imported: without the cu13 extra or a Hopper GPU, one line says what is missing.
require_gpu()

import cupy as cp

H, I, E, K, T = 1024, 512, 32, 6, a.tokens
rs = cp.random.RandomState(0)
hidden = rs.standard_normal((T, H), dtype=cp.float32)  # the tokens' activations
gate = rs.standard_normal((H, E), dtype=cp.float32) / 32  # the router's weights
w1, w1_sf = quantize_weight_fp8(rs.standard_normal((E, 2 * I, H), dtype=cp.float32) / 32)
w2, w2_sf = quantize_weight_fp8(rs.standard_normal((E, H, I), dtype=cp.float32) / 32)
cp.cuda.get_current_stream().synchronize()

cfg = StreamConfig(num_slots=a.slots, tokens_per_slot=a.chunk)
producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
layer = MegaMoE(H, I, E, K, T, streaming=cfg)
layer.load_weights(w1, w1_sf, w2, w2_sf, stream=consumer)
# The router's kernels (megamoe_rt/routers.py: a gating product, softmax and top-k that
# includes "stream/producer.cuh" and writes each chunk into the ring's slot) load when it is built.
router = Router(E, K, layer)
# Every kernel the producer launches must be loaded before the layer waits on the device
# (docs/STREAMING.md, "Progress"): the router runs once beforehand.
router.warm(hidden, gate, producer)
consumer.synchronize()

# Streamed: the layer is enqueued first and waits on the device; the producer follows on its
# own stream, one launch per round of the ring.
y = layer.consume(T, stream=consumer)
chunk_logits = router.produce(hidden, gate, producer)
consumer.synchronize()
producer.synchronize()

# The same call made the usual way: every token routed by the same router at once, then the layer.
batch = MegaMoE(H, I, E, K, T, mode="unfused")
batch.load_weights(w1, w1_sf, w2, w2_sf)
x, x_sf, topk_idx, topk_weights, logits = router.route_batch(hidden, gate)
y_batch = batch(x, x_sf, topk_idx, topk_weights)
q, q_sf = quantize_fp8(hidden)
cp.cuda.Device().synchronize()
print(f"{T} tokens in {cfg.num_chunks(T)} chunks through a ring of {cfg.num_slots} x {cfg.tokens_per_slot} tokens")
print("router's activations == quantize_fp8(hidden):", bool(cp.array_equal(x, q) and cp.array_equal(x_sf, q_sf)))
print("chunk logits == batch logits:", bool(cp.array_equal(cp.concatenate(chunk_logits), logits)))
print("streamed == batch, bitwise:", bool(cp.array_equal(y, y_batch)))
