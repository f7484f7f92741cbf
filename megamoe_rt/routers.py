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

// Built per router: ROUTER_EXPERTS is its expert count (router_options()).
constexpr u32 kExperts = ROUTER_EXPERTS;
constexpr u32 kExpertSlices = (kExperts + 31) / 32;  // a lane holds experts lane, lane + 32, ...
constexpr u32 kTileTokens = 8;                       // tokens per block
constexpr u32 kWarps = 8;                            // blockDim 256: each warp a slice of the hidden dimension
static_assert(kTileTokens == kWarps, "one warp routes each token of the tile");

// Token `l`'s routing (one warp): softmax over the experts' logits, the top-k picked largest
// first (ties: the lower expert), their probabilities renormalised. Lane 0 writes `idx` / `w`.
// Every router entry point routes through this, so the streamed chunks and the batch call get
// the same bits from the same logits.
__device__ void route_row(const float* l, u32 k, i32* idx, float* w, u32 lane) {
    float top = -3.0e38f;
    for (u32 e = lane; e < kExperts; e += 32) top = fmaxf(top, l[e]);
    for (u32 off = 16; off > 0; off /= 2) top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, off));
    float prev = 3.0e38f, sum = 0.0f;
    int prev_e = -1;
    for (u32 j = 0; j < k; ++j) {
        float best = -3.0e38f;
        int best_e = -1;
        for (u32 e = lane; e < kExperts; e += 32) {
            const bool after_prev = l[e] < prev || (l[e] == prev && static_cast<int>(e) > prev_e);
            if (after_prev && (l[e] > best || best_e < 0)) best = l[e], best_e = static_cast<int>(e);
        }
        for (u32 off = 16; off > 0; off /= 2) {  // the larger logit wins, ties the lower expert, none loses
            const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, off);
            const int oe = __shfl_xor_sync(0xFFFFFFFFu, best_e, off);
            if (oe >= 0 && (best_e < 0 || ob > best || (ob == best && oe < best_e))) best = ob, best_e = oe;
        }
        if (lane == 0) {
            idx[j] = best_e;
            w[j] = __expf(best - top);
            sum += w[j];
        }
        prev = best, prev_e = best_e;
    }
    if (lane == 0)
        for (u32 j = 0; j < k; ++j) w[j] /= sum;
}

// The gating product of `rows` (<= kTileTokens) tokens: hidden [rows, hidden_dim] (float32,
// 16-byte aligned rows) times gate [hidden_dim, kExperts] into `logits` [kTileTokens][kExperts]
// (shared). Warp w sums its own slice of the hidden dimension; the slices are added in warp
// order, so a token's logits do not depend on where it sits in a call or chunk.
__device__ void gate_tile(const float* hidden, u32 rows, u32 hidden_dim, const float* gate, float* logits) {
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 span = hidden_dim / kWarps;  // hidden_dim is a multiple of 128
    float acc[kTileTokens][kExpertSlices];
#pragma unroll
    for (u32 t = 0; t < kTileTokens; ++t)
#pragma unroll
        for (u32 s = 0; s < kExpertSlices; ++s) acc[t][s] = 0.0f;
#pragma unroll 2
    for (u32 k = warp * span; k < (warp + 1) * span; k += 4) {
        float4 h[kTileTokens];
#pragma unroll
        for (u32 t = 0; t < kTileTokens; ++t)
            h[t] = t < rows ? __ldg(reinterpret_cast<const float4*>(hidden + static_cast<u64>(t) * hidden_dim + k))
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (u32 j = 0; j < 4; ++j) {
#pragma unroll
            for (u32 s = 0; s < kExpertSlices; ++s) {
                const u32 e = s * 32 + lane;
                const float g = e < kExperts ? __ldg(gate + static_cast<u64>(k + j) * kExperts + e) : 0.0f;
#pragma unroll
                for (u32 t = 0; t < kTileTokens; ++t) {
                    const float x = j == 0 ? h[t].x : j == 1 ? h[t].y : j == 2 ? h[t].z : h[t].w;
                    acc[t][s] = fmaf(x, g, acc[t][s]);
                }
            }
        }
    }
    for (u32 w = 0; w < kWarps; ++w) {
        if (warp == w) {
#pragma unroll
            for (u32 t = 0; t < kTileTokens; ++t)
#pragma unroll
                for (u32 s = 0; s < kExpertSlices; ++s) {
                    const u32 e = s * 32 + lane;
                    if (e < kExperts) logits[t * kExperts + e] = w == 0 ? acc[t][s] : logits[t * kExperts + e] + acc[t][s];
                }
        }
        __syncthreads();
    }
}

// One block's tokens [t0, t0 + rows): logits, routes and the activations quantized (the
// quantizer's own step, so they are the bytes quantize_fp8 gives). Outputs are row-indexed from
// the tile's first token; `logits_out` may be null.
__device__ void route_tile(const float* hidden, u32 rows, u32 hidden_dim, const float* gate, u32 k, i32* idx, float* w,
                           u8* x, float* x_sf, float* logits_out) {
    __shared__ float logits[kTileTokens * kExperts];
    gate_tile(hidden, rows, hidden_dim, gate, logits);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < rows) {
        route_row(logits + warp * kExperts, k, idx + warp * k, w + warp * k, lane);
        if (logits_out != nullptr)
            for (u32 e = lane; e < kExperts; e += 32) logits_out[warp * kExperts + e] = logits[warp * kExperts + e];
    }
    const u64 groups = static_cast<u64>(rows) * (hidden_dim / 128);
    for (u64 pair = warp; pair * 2 < groups; pair += kWarps)
        quantize_group_pair<false>(hidden, groups, pair, lane, x, x_sf);
}

// One launch per chunk (ceil(tokens_per_slot / kTileTokens) blocks of 256 threads): the chunk's
// gating product, routing and quantized activations straight into its slot, both halves
// published by the last block done. `hidden` holds the chunk's `n` rows; tokens past `n` get
// empty routes, so the slot describes itself. Every block first waits for the slot to be free
// (the wait only reads). `slot_done` counts the blocks done with each slot in this call (zeroed
// at the call's start): a slot's k-th chunk of the call is complete once every block has counted
// it k times.
extern "C" __global__ void __launch_bounds__(256) produce_chunk(const stream::StreamRing* ring_ptr, const float* hidden,
                                                                const float* gate, u32 n, u32 chunk, u32* slot_done,
                                                                float* logits_out) {
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
    const u32 t0 = blockIdx.x * kTileTokens;
    const u32 rows = t0 < n ? min(kTileTokens, n - t0) : 0;
    i32* idx = stream::chunk_topk_idx(ring, chunk) + static_cast<u64>(t0) * ring.num_topk;
    float* w = stream::chunk_topk_weights(ring, chunk) + static_cast<u64>(t0) * ring.num_topk;
    if (rows > 0)
        route_tile(hidden + static_cast<u64>(t0) * ring.hidden, rows, ring.hidden, gate, ring.num_topk, idx, w,
                   stream::chunk_x(ring, chunk) + static_cast<u64>(t0) * ring.hidden,
                   stream::chunk_x_sf(ring, chunk) + static_cast<u64>(t0) * (ring.hidden / 128),
                   logits_out == nullptr ? nullptr : logits_out + static_cast<u64>(t0) * kExperts);
    const u32 last = min(kTileTokens, ring.tokens_per_slot - min(t0, ring.tokens_per_slot));
    for (u32 i = rows * ring.num_topk + threadIdx.x; i < last * ring.num_topk; i += blockDim.x)
        idx[i] = -1, w[i] = 0.0f;
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

// The batch call's inputs, every token at once (ceil(T / kTileTokens) blocks of 256 threads):
// the same logits, routes and quantized activations the chunks of a streamed call get.
extern "C" __global__ void __launch_bounds__(256) route_batch(const float* hidden, const float* gate, u32 num_tokens,
                                                              u32 hidden_dim, u32 k, i32* idx, float* w, u8* x,
                                                              float* x_sf, float* logits_out) {
    const u32 t0 = blockIdx.x * kTileTokens;
    if (t0 >= num_tokens) return;
    route_tile(hidden + static_cast<u64>(t0) * hidden_dim, min(kTileTokens, num_tokens - t0), hidden_dim, gate, k,
               idx + static_cast<u64>(t0) * k, w + static_cast<u64>(t0) * k, x + static_cast<u64>(t0) * hidden_dim,
               x_sf + static_cast<u64>(t0) * (hidden_dim / 128),
               logits_out == nullptr ? nullptr : logits_out + static_cast<u64>(t0) * kExperts);
}

// Routing only, from given logits [T, kExperts]: a warp per token.
extern "C" __global__ void __launch_bounds__(256) route_all(const float* logits, u32 num_tokens, u32 k, i32* idx,
                                                            float* w) {
    const u32 token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (token < num_tokens)
        route_row(logits + static_cast<u64>(token) * kExperts, k, idx + static_cast<u64>(token) * k,
                  w + static_cast<u64>(token) * k, threadIdx.x % 32);
}
"""


# Logits a router kernel keeps in registers per token tile (8 tokens x experts / 32 per lane).
MAX_EXPERTS = 512


def router_options(num_experts: int) -> list[str]:
    """NVRTC options of the router module built for ``num_experts`` logits per token."""
    return [*producer_options(), f"-DROUTER_EXPERTS={num_experts}"]


class Router:
    """The router of ``layer`` (a streamed layer, or None for whole-call routing only):
    ``num_experts`` logits per token from a float32 gating product, the top ``num_topk``.

    The gating product runs inside the router's own kernels (a tile of 8 tokens per block, the
    hidden dimension split over its warps and summed in a fixed order), so a chunk costs one
    launch, and a token's logits are the same bits in a streamed chunk and in the batch call."""

    def __init__(self, num_experts: int, num_topk: int, layer: Any = None):
        import cupy as cp

        if not 1 <= num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts={num_experts}: expected 1..{MAX_EXPERTS} (a lane holds one logit per 32)")
        if not 1 <= num_topk <= num_experts:
            raise ValueError(f"num_topk={num_topk}: expected 1..num_experts={num_experts}")
        self.cp, self.num_experts, self.num_topk, self.layer = cp, num_experts, num_topk, layer
        module = cp.RawModule(code=ROUTER, options=tuple(router_options(num_experts)))
        # get_function loads each kernel now, not at its first launch (see produce()).
        names = ("produce_chunk", "route_batch", "route_all")
        self._produce_chunk, self._route_batch, self._route_all = (module.get_function(n) for n in names)
        if layer is not None:
            ring = layer.input_ring
            self.config = layer.streaming
            self._ring = ring
            self._ring_dev = cp.asarray(np.frombuffer(bytes(ring.descriptor), dtype=np.uint8))
            self._slot_done = cp.zeros(self.config.num_slots, dtype=cp.uint32)

    def _check_inputs(self, hidden: Any, gate: Any, hidden_size: int | None = None) -> None:
        cp = self.cp
        for name, a in (("hidden", hidden), ("gate", gate)):
            if not isinstance(a, cp.ndarray) or a.dtype != cp.float32 or a.ndim != 2:
                got = f"{type(a).__name__} {getattr(a, 'dtype', '')} {list(getattr(a, 'shape', []))}"
                raise TypeError(f"{name}: expected a 2-D float32 CuPy array, got {got}")
            if not a.flags.c_contiguous or a.data.ptr % 16:
                raise ValueError(f"{name}: expected a C-contiguous array with a 16-byte aligned start")
        h = hidden.shape[1]
        if h % 128 or (hidden_size is not None and h != hidden_size):
            want = f"{hidden_size}" if hidden_size is not None else "a multiple of 128"
            raise ValueError(f"hidden: shape {list(hidden.shape)}, expected [T, {want}]")
        if gate.shape != (h, self.num_experts):
            raise ValueError(f"gate: shape {list(gate.shape)}, expected [{h}, {self.num_experts}]")

    def route_all(self, logits: Any, topk_idx: Any, topk_weights: Any) -> None:
        """Every token of ``logits`` ``[T, E]`` float32 into ``topk_idx`` / ``topk_weights`` ``[T, K]``
        (on CuPy's current stream)."""
        t = logits.shape[0]
        if t:
            self._route_all(
                (-(-t // 8),), (256,), (logits, np.uint32(t), np.uint32(self.num_topk), topk_idx, topk_weights)
            )

    def route_batch(self, hidden: Any, gate: Any) -> tuple[Any, Any, Any, Any, Any]:
        """A whole call's layer inputs in one launch on CuPy's current stream: ``(x, x_sf,
        topk_idx, topk_weights, logits)`` for ``hidden`` (float32 ``[T, H]``) and ``gate``
        (float32 ``[H, E]``), the bits a streamed call's chunks get (``x`` / ``x_sf`` are what
        ``quantize_fp8(hidden)`` gives)."""
        cp = self.cp
        self._check_inputs(hidden, gate)
        t, h = hidden.shape
        k = self.num_topk
        x, x_sf = cp.empty((t, h), cp.uint8), cp.empty((t, h // 128), cp.float32)
        idx, w = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32)
        logits = cp.empty((t, self.num_experts), cp.float32)
        if t:
            args = (hidden, gate, np.uint32(t), np.uint32(h), np.uint32(k), idx, w, x, x_sf, logits)
            self._route_batch((-(-t // 8),), (256,), args)
        return x, x_sf, idx, w, logits

    def warm(self, hidden: Any, gate: Any, stream: Any) -> None:
        """Run the router once on ``stream`` over a few of ``hidden``'s tokens and wait. A kernel
        whose first launch still has work to do (CUDA lazy loading) may wait for the context to
        go idle, which it never does while the layer spins on a chunk."""
        with stream:
            self.route_batch(hidden[:8], gate)
        stream.synchronize()

    def produce(self, hidden: Any, gate: Any, stream: Any) -> list[Any]:
        """A streamed call's inputs, chunk by chunk on ``stream``: one launch per chunk computes
        the gating product of the chunk's ``hidden`` rows (float32 ``[T, H]``, C-contiguous) with
        ``gate`` (float32 ``[H, E]``), routes the chunk into its slot, quantizes its activations
        there (the bytes ``quantize_fp8`` gives) and publishes both halves. Returns the chunks'
        logits (for checking against :meth:`route_all`)."""
        cp = self.cp
        cfg, t = self.config, hidden.shape[0]
        self._check_inputs(hidden, gate, self._ring.layout.hidden)
        c = cfg.tokens_per_slot
        if t > self.layer.num_max_tokens_per_rank:
            raise ValueError(f"hidden: {t} tokens, more than the layer's capacity {self.layer.num_max_tokens_per_rank}")
        out = []
        with stream:
            logits = cp.empty((t, self.num_experts), cp.float32)
            self._ring.begin_call(stream.ptr)
            self._slot_done.fill(0)
            for chunk in range(cfg.num_chunks(t)):
                first, n = chunk * c, cfg.chunk_tokens(t, chunk)
                out.append(logits[first : first + n])
                args = (self._ring_dev, hidden[first:], gate, np.uint32(n), np.uint32(chunk), self._slot_done, out[-1])
                self._produce_chunk((-(-c // 8),), (256,), args)
        return out
