"""A reference producer for streamed calls: a softmax top-k router compiled with CuPy that
routes each chunk of tokens straight into a layer's input ring (``streaming=``), plus the
same routing for a whole call at once. ``examples/streaming_router.py`` and ``megamoe-rt bench
stream`` use it; a model's own router kernel takes its place (docs/STREAMING.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megamoe_rt.kernels.stream import producer_options

ROUTER = r"""
#include "quantize/group_1x128.cuh"
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

// One launch per chunk: the chunk's routing and its activations quantized straight into its
// slot, both halves published by the last block done. `logits` are the chunk's rows (`n` of
// them; tokens past `n` get empty routes, so the slot describes itself), `hidden` its float32
// activation rows. Every block first waits for the slot to be free (the wait only reads).
// `slot_done` counts the blocks done with each slot in this call (zeroed at the call's start):
// a slot's k-th chunk of the call is complete once every block has counted it k times.
extern "C" __global__ void __launch_bounds__(256) produce_chunk(const stream::StreamRing* ring_ptr, const float* logits,
                                                                const float* hidden, u32 n, u32 experts, u32 chunk,
                                                                u32* slot_done) {
    const stream::StreamRing ring = *ring_ptr;
    __shared__ int free_slot;
    if (threadIdx.x == 0) free_slot = stream::wait_slot_free(ring, chunk, 60ull * 1000 * 1000 * 1000);
    __syncthreads();
    if (!free_slot) {  // the layer never released the slot: say which wait, then stop
        if (threadIdx.x == 0)
            printf("megamoe_rt.routers: wait 'stream slot free' timed out after 60 s: slot %u (chunk %u) was never "
                   "released by the layer\n", stream::slot_of(ring, chunk), chunk);
        __trap();
    }
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < ring.tokens_per_slot; t += gridDim.x * blockDim.x) {
        i32* idx = stream::chunk_topk_idx(ring, chunk) + t * ring.num_topk;
        float* w = stream::chunk_topk_weights(ring, chunk) + t * ring.num_topk;
        if (t < n) {
            route_token(logits, t, experts, ring.num_topk, idx, w);
        } else {
            for (u32 j = 0; j < ring.num_topk; ++j) idx[j] = -1, w[j] = 0.0f;
        }
    }
    // The activations: two 128-wide groups per warp and step, the quantizer's own step, so the
    // slot holds the bytes quantize_fp8 gives the batch call.
    const u64 groups = static_cast<u64>(n) * (ring.hidden / 128);
    const u64 warps = static_cast<u64>(gridDim.x) * (blockDim.x / 32);
    for (u64 pair = (static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; pair * 2 < groups; pair += warps)
        quantize_group_pair<false>(hidden, groups, pair, threadIdx.x % 32, stream::chunk_x(ring, chunk),
                                   stream::chunk_x_sf(ring, chunk));
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the block's payload before its count
        const u32 target = gridDim.x * (chunk / ring.num_slots + 1);
        if (atomicAdd(slot_done + stream::slot_of(ring, chunk), 1u) + 1 == target) {
            const u32 epoch = stream::producer_epoch(ring);
            stream::publish_route(ring, epoch, chunk);
            stream::publish_layout(ring, epoch, chunk);
        }
    }
}

// The batch call's routing, every token at once.
extern "C" __global__ void route_all(const float* logits, u32 num_tokens, u32 experts, u32 k, i32* idx, float* w) {
    const u32 token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token < num_tokens) route_token(logits, token, experts, k, idx + token * k, w + token * k);
}
"""


class Router:
    """The router of ``layer`` (a streamed layer, or None for whole-call routing only):
    ``num_experts`` logits per token, the top ``num_topk``."""

    def __init__(self, num_experts: int, num_topk: int, layer: Any = None):
        import cupy as cp

        self.cp, self.num_experts, self.num_topk, self.layer = cp, num_experts, num_topk, layer
        module = cp.RawModule(code=ROUTER, options=tuple(producer_options()))
        # get_function loads each kernel now, not at its first launch (see produce()).
        self._produce_chunk, self._route_all = (module.get_function(n) for n in ("produce_chunk", "route_all"))
        if layer is not None:
            ring = layer.input_ring
            self.config = layer.streaming
            self._ring = ring
            self._ring_dev = cp.asarray(np.frombuffer(bytes(ring.descriptor), dtype=np.uint8))
            self._slot_done = cp.zeros(self.config.num_slots, dtype=cp.uint32)
            self._sm_count = cp.cuda.Device().attributes["MultiProcessorCount"]

    def route_all(self, logits: Any, topk_idx: Any, topk_weights: Any) -> None:
        """Every token of ``logits`` ``[T, E]`` float32 into ``topk_idx`` / ``topk_weights`` ``[T, K]``
        (on CuPy's current stream)."""
        t = logits.shape[0]
        e, k = np.uint32(self.num_experts), np.uint32(self.num_topk)
        self._route_all(((t + 127) // 128,), (128,), (logits, np.uint32(t), e, k, topk_idx, topk_weights))

    def warm(self, hidden: Any, gate: Any, stream: Any) -> None:
        """Run the producer's CuPy work once on ``stream`` at every chunk size a call of
        ``hidden``'s tokens has. A kernel's first launch may wait for the context to go idle
        (CUDA lazy loading), which it never does while the layer spins on a chunk; cuBLAS picks
        its kernel by shape."""
        cfg, t = self.config, hidden.shape[0]
        with stream:
            for n in sorted({cfg.chunk_tokens(t, c) for c in range(cfg.num_chunks(t))}):
                _ = hidden[:n] @ gate  # the product is not needed, the kernel load is
        stream.synchronize()

    def produce(self, hidden: Any, gate: Any, stream: Any) -> list[Any]:
        """A streamed call's inputs, chunk by chunk on ``stream``: the gating GEMM of the chunk's
        ``hidden`` rows (float32 ``[T, H]``, C-contiguous) with ``gate`` ``[H, E]``, then one launch
        that routes the chunk into its slot, quantizes its activations there (the bytes
        ``quantize_fp8`` gives) and publishes both halves. Returns the chunks' logits (for
        checking against :meth:`route_all`)."""
        cfg, t = self.config, hidden.shape[0]
        out = []
        c, h = cfg.tokens_per_slot, hidden.shape[1]
        # Enough blocks for a thread per token of the slot and a warp per two groups of the
        # chunk's activations, within a few waves.
        blocks = max(-(-c // 256), min(-(-c * (h // 128) // 16), self._sm_count * 4))
        with stream:
            self._ring.begin_call(stream.ptr)
            self._slot_done.fill(0)
            for chunk in range(cfg.num_chunks(t)):
                first, n = chunk * c, cfg.chunk_tokens(t, chunk)
                logits = hidden[first : first + n] @ gate
                out.append(logits)
                args = (
                    self._ring_dev,
                    logits,
                    hidden[first : first + n],
                    np.uint32(n),
                    np.uint32(self.num_experts),
                    np.uint32(chunk),
                    self._slot_done,
                )
                self._produce_chunk((blocks,), (256,), args)
        return out
