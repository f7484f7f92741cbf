"""A router that streams a layer call's inputs: a CuPy kernel routes each chunk of tokens
(softmax over the experts, top-k) straight into the layer's input ring and CuPy quantizes its
activations there, on a producer stream, while the layer consumes the chunks already
published on its own stream. The result is checked against the same call made the usual way
(all tokens routed first, then the layer). Run on a Hopper GPU:

    python examples/streaming_router.py [--tokens 4096] [--slots 4] [--chunk 512]
"""

import argparse

import cupy as cp
import numpy as np

from megamoe_rt import MegaMoE, quantize_fp8, quantize_weight_fp8
from megamoe_rt.streaming import StreamConfig, producer_options

ROUTER = r"""
#include "stream/producer.cuh"
using namespace megamoe_rt;

// Token `token`'s routing: softmax over the experts' logits, the top-k picked largest first
// (ties: the lower expert), their probabilities renormalised. The same code routes the
// streamed chunks and the batch call, so both get the same bits.
__device__ void route_token(const float* logits, u32 token, u32 experts, u32 k, i32* idx, float* w) {
    const float* l = logits + static_cast<u64>(token) * experts;
    float top = -3.0e38f;
    for (u32 e = 0; e < experts; ++e) top = fmaxf(top, l[e]);
    float prev = 3.0e38f;
    int prev_e = -1;
    float sum = 0.0f;
    for (u32 j = 0; j < k; ++j) {
        float best = -3.0e38f;
        int best_e = -1;
        for (u32 e = 0; e < experts; ++e) {
            const bool after_prev = l[e] < prev || (l[e] == prev && static_cast<int>(e) > prev_e);
            if (after_prev && (l[e] > best || best_e < 0)) best = l[e], best_e = static_cast<int>(e);
        }
        idx[j] = best_e;
        w[j] = __expf(best - top);
        sum += w[j];
        prev = best, prev_e = best_e;
    }
    for (u32 j = 0; j < k; ++j) w[j] /= sum;
}

// One block per chunk: wait for the slot, route the chunk's tokens (`logits`: their rows,
// `n` of them) into it, publish the routing half.
extern "C" __global__ void route_chunk(const stream::StreamRing* ring_ptr, const float* logits, u32 n, u32 experts,
                                       u32 chunk) {
    const stream::StreamRing ring = *ring_ptr;
    __shared__ int free_slot;
    if (threadIdx.x == 0) free_slot = stream::wait_slot_free(ring, chunk, 60ull * 1000 * 1000 * 1000);
    __syncthreads();
    if (!free_slot) __trap();
    i32* idx = stream::chunk_topk_idx(ring, chunk);
    float* w = stream::chunk_topk_weights(ring, chunk);
    for (u32 t = threadIdx.x; t < ring.tokens_per_slot; t += blockDim.x) {
        if (t < n) {
            route_token(logits, t, experts, ring.num_topk, idx + t * ring.num_topk, w + t * ring.num_topk);
        } else {
            for (u32 j = 0; j < ring.num_topk; ++j) idx[t * ring.num_topk + j] = -1, w[t * ring.num_topk + j] = 0.0f;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) stream::publish_route(ring, stream::producer_epoch(ring), chunk);
}

// After the chunk's x / x_sf are written (earlier kernels on this stream): the activation half.
extern "C" __global__ void publish_x(const stream::StreamRing* ring_ptr, u32 chunk) {
    if (threadIdx.x == 0) stream::publish_layout(*ring_ptr, stream::producer_epoch(*ring_ptr), chunk);
}

// The batch call's routing, every token at once.
extern "C" __global__ void route_all(const float* logits, u32 num_tokens, u32 experts, u32 k, i32* idx, float* w) {
    const u32 token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token < num_tokens) route_token(logits, token, experts, k, idx + token * k, w + token * k);
}
"""

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--slots", type=int, default=4)
ap.add_argument("--chunk", type=int, default=512)
a = ap.parse_args()

H, I, E, K, T = 1024, 512, 32, 6, a.tokens
rs = cp.random.RandomState(0)
hidden = rs.standard_normal((T, H), dtype=cp.float32)  # the tokens' activations
gate = rs.standard_normal((H, E), dtype=cp.float32) / 32  # the router's weights
w1, w1_sf = quantize_weight_fp8(rs.standard_normal((E, 2 * I, H), dtype=cp.float32) / 32)
w2, w2_sf = quantize_weight_fp8(rs.standard_normal((E, H, I), dtype=cp.float32) / 32)
cp.cuda.get_current_stream().synchronize()

module = cp.RawModule(code=ROUTER, options=tuple(producer_options()))
route_chunk, publish_x, route_all = (module.get_function(n) for n in ("route_chunk", "publish_x", "route_all"))

cfg = StreamConfig(num_slots=a.slots, tokens_per_slot=a.chunk)
producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
layer = MegaMoE(H, I, E, K, T, streaming=cfg)
layer.load_weights(w1, w1_sf, w2, w2_sf, stream=consumer)
ring = layer.input_ring
ring_dev = cp.asarray(np.frombuffer(bytes(ring.descriptor), dtype=np.uint8))  # the descriptor, for the kernels
x_ring, sf_ring = layer.buffer.view("stream_x"), layer.buffer.view("stream_x_sf")
consumer.synchronize()

# Streamed: the layer is enqueued first and waits on the device; the producer follows on its
# own stream, chunk by chunk: the gating GEMM, the routing into the slot, the activations
# quantized into the slot, each half published.
y = layer.consume(T, stream=consumer)
chunk_logits = []
with producer:
    ring.begin_call(producer.ptr)
    for chunk in range(cfg.num_chunks(T)):
        first, n = chunk * cfg.tokens_per_slot, cfg.chunk_tokens(T, chunk)
        logits = hidden[first : first + n] @ gate
        chunk_logits.append(logits)
        route_chunk((1,), (256,), (ring_dev, logits, np.uint32(n), np.uint32(E), np.uint32(chunk)))
        row = (chunk % cfg.num_slots) * cfg.tokens_per_slot
        quantize_fp8(
            hidden[first : first + n], out=x_ring[row : row + n], out_sf=sf_ring[row : row + n], stream=producer
        )
        publish_x((1,), (32,), (ring_dev, np.uint32(chunk)))
consumer.synchronize()
producer.synchronize()

# The same call made the usual way: every token routed (from the same logits), then the layer.
batch = MegaMoE(H, I, E, K, T, mode="unfused")
batch.load_weights(w1, w1_sf, w2, w2_sf)
logits = cp.concatenate(chunk_logits)
topk_idx, topk_weights = cp.empty((T, K), cp.int32), cp.empty((T, K), cp.float32)
route_all(((T + 127) // 128,), (128,), (logits, np.uint32(T), np.uint32(E), np.uint32(K), topk_idx, topk_weights))
x, x_sf = quantize_fp8(hidden)
y_batch = batch(x, x_sf, topk_idx, topk_weights)
cp.cuda.Device().synchronize()
print(f"{T} tokens in {cfg.num_chunks(T)} chunks through a ring of {cfg.num_slots} x {cfg.tokens_per_slot} tokens")
print("streamed == batch, bitwise:", bool(cp.array_equal(y, y_batch)))
