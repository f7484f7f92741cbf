"""A reference producer for streamed calls: a softmax top-k router compiled with CuPy that
routes each chunk of tokens straight into a layer's input ring (``streaming=``), plus the
same routing for a whole call at once. ``examples/streaming_router.py`` and ``megamoe-rt bench
stream`` use it; a model's own router kernel takes its place (docs/STREAMING.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megamoe_rt.kernels.stream import producer_options
from megamoe_rt.runtime import args as arg_checks
from megamoe_rt.runtime.deadlines import wait_timeout_ns

ROUTER = r"""
#include "quantize/group_1x128.cuh"
#include "stream/producer.cuh"
using namespace megamoe_rt;

// Built per router: ROUTER_EXPERTS is its expert count (router_options()).
constexpr u32 kExperts = ROUTER_EXPERTS;
constexpr u32 kThreads = 256;
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kTileTokens = ROUTER_TILE_TOKENS;          // tokens of a block (TILE_TOKENS)
constexpr u32 kExpertTile = kExperts <= 32 ? 32 : 64;    // experts per pass of the product
constexpr u32 kTokensPerThread = kTileTokens * kExpertTile / (kThreads * 4);  // each thread: these x 4 experts
constexpr u32 kMaxSlices = ROUTER_MAX_SLICES;            // slices of the hidden dimension (MAX_SLICES)
constexpr u32 kStepK = 32;                               // hidden elements staged in shared memory per step
static_assert(kTokensPerThread == 1 || kTokensPerThread == 2, "a thread's micro-tile");

// Token `l`'s routing (one warp): softmax over the experts' logits, the top-k picked largest
// first (ties: the lower expert), their probabilities renormalised. Every router entry point
// routes through this, so the streamed chunks and the batch call get the same bits from the
// same logits. The butterfly leaves every lane with each round's winner, so every lane sums the
// probabilities (in pick order) in a register and lane j % 32 writes pick j: no store is read
// back until the last division, which each lane makes on its own picks. Not inlined, so every
// kernel runs one copy of it (and produce_chunks stays within its register budget).
__device__ __noinline__ void route_row(const float* l, u32 k, i32* idx, float* w, u32 lane) {
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
        const float p = __expf(best - top);
        sum += p;
        if (j % 32 == lane) idx[j] = best_e, w[j] = p;
        prev = best, prev_e = best_e;
    }
    for (u32 j = lane; j < k; j += 32) w[j] /= sum;
}

// What one block of a router launch works on: token tile `tile` (rows [t0, t0 + rows) of the
// call or chunk) and slice `slice` of the hidden dimension, [k_begin, k_end).
struct TileSlice {
    const float* hidden;  // the tile's first row, row stride hidden_dim
    u32 rows, hidden_dim, k_begin, k_end;
};

constexpr u32 kPadK = 4;  // keeps the rows of the staged hidden tile 16-byte aligned and off each other's banks
constexpr u32 kStageHBytes = kTileTokens * (kStepK + kPadK) * 4;
constexpr u32 kStageGBytes = kStepK * kExpertTile * 4;
constexpr u32 kPipelineBytes = 2 * (kStageHBytes + kStageGBytes);
constexpr u32 kRouteRowBytes = kWarps * kExperts * 4;  // the last block: a warp's token's logits
constexpr u32 kSmemBytes = kPipelineBytes > kRouteRowBytes ? kPipelineBytes : kRouteRowBytes;
static_assert(kSmemBytes <= 48 * 1024, "static shared memory");

__device__ __forceinline__ void cp_async_zfill(void* dst, const void* src, u32 bytes, bool valid) {
    const u32 d = static_cast<u32>(__cvta_generic_to_shared(dst));
    if (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16u : 0u) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(valid ? 4u : 0u) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// The slice's share of the tile's gating product, into `partial` [kTileTokens][kExperts]
// (global): a shared-memory tiled product with the next k-step's tiles loaded (cp.async) while
// this one is multiplied, each thread a kTokensPerThread x 4 micro-tile summed along k in order.
__device__ void gate_partial(const TileSlice& ts, const float* gate, float* partial, u8* smem) {
    auto sh_h = [&](u32 buf) { return reinterpret_cast<float(*)[kStepK + kPadK]>(smem + buf * kStageHBytes); };
    auto sh_g = [&](u32 buf) {
        return reinterpret_cast<float(*)[kExpertTile]>(smem + 2 * kStageHBytes + buf * kStageGBytes);
    };
    const u32 eg = threadIdx.x % (kExpertTile / 4), tg = threadIdx.x / (kExpertTile / 4);
    for (u32 e0 = 0; e0 < kExperts; e0 += kExpertTile) {
        auto load = [&](u32 buf, u32 k0) {
            for (u32 i = threadIdx.x; i < kTileTokens * (kStepK / 4); i += kThreads) {
                const u32 t = i / (kStepK / 4), c = i % (kStepK / 4);
                const bool valid = t < ts.rows;
                cp_async_zfill(&sh_h(buf)[t][c * 4], ts.hidden + (valid ? static_cast<u64>(t) * ts.hidden_dim + k0 + c * 4 : 0),
                               16, valid);
            }
            for (u32 i = threadIdx.x; i < kStepK * kExpertTile; i += kThreads) {
                const u32 k = i / kExpertTile, e = e0 + i % kExpertTile;
                const bool valid = e < kExperts;
                cp_async_zfill(&sh_g(buf)[k][i % kExpertTile], gate + (valid ? static_cast<u64>(k0 + k) * kExperts + e : 0), 4,
                               valid);
            }
            cp_async_commit();
        };
        float acc[kTokensPerThread][4] = {};
        load(0, ts.k_begin);
        u32 buf = 0;
        for (u32 k0 = ts.k_begin; k0 < ts.k_end; k0 += kStepK, buf ^= 1) {
            if (k0 + kStepK < ts.k_end)
                load(buf ^ 1, k0 + kStepK);
            else
                cp_async_commit();  // an empty group keeps the wait below at "all but the newest"
            cp_async_wait_one();
            __syncthreads();
            const auto h_tile = sh_h(buf);
            const auto g_tile = sh_g(buf);
#pragma unroll 8
            for (u32 k = 0; k < kStepK; ++k) {
                const float4 g = *reinterpret_cast<const float4*>(&g_tile[k][eg * 4]);
#pragma unroll
                for (u32 i = 0; i < kTokensPerThread; ++i) {
                    const float h = h_tile[tg * kTokensPerThread + i][k];
                    acc[i][0] = fmaf(h, g.x, acc[i][0]);
                    acc[i][1] = fmaf(h, g.y, acc[i][1]);
                    acc[i][2] = fmaf(h, g.z, acc[i][2]);
                    acc[i][3] = fmaf(h, g.w, acc[i][3]);
                }
            }
            __syncthreads();  // the buffer is refilled two steps on
        }
#pragma unroll
        for (u32 i = 0; i < kTokensPerThread; ++i)
#pragma unroll
            for (u32 j = 0; j < 4; ++j) {
                const u32 t = tg * kTokensPerThread + i, e = e0 + eg * 4 + j;
                if (e < kExperts) partial[t * kExperts + e] = acc[i][j];
            }
    }
}

// The slice's 1x128 groups of the tile's activations, with the quantizer's own step (the bytes
// quantize_fp8 gives). x / x_sf: the tile's first row.
__device__ void quantize_slice(const TileSlice& ts, u8* x, float* x_sf) {
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 g0 = ts.k_begin / 128, groups = (ts.k_end - ts.k_begin) / 128, pairs = (groups + 1) / 2;
    for (u32 item = warp; item < ts.rows * pairs; item += kWarps) {
        const u32 t = item / pairs, pair = item % pairs;
        const u64 row = static_cast<u64>(t) * ts.hidden_dim;
        quantize_group_pair<false>(ts.hidden + row + ts.k_begin, groups, pair, lane, x + row + ts.k_begin,
                                   x_sf + static_cast<u64>(t) * (ts.hidden_dim / 128) + g0);
    }
}

// Every block of a tile writes its slice's partial product and counts itself in; the last one
// adds the slices in slice order (so a token's logits do not depend on where it sits in a call or
// chunk) into `logits` (the tile's rows), routes the tile's tokens into idx / w (k per token)
// and gives `empty_rows` tokens past the tile's rows empty routes. Returns in every block once
// its part is written; `counter` is back at 0 when the last block returns.
__device__ void gate_route_tile(const TileSlice& ts, u32 slice, u32 num_slices, const float* gate, float* partials,
                                u32* counter, float* logits, u32 k, i32* idx, float* w, u32 empty_rows) {
    __shared__ __align__(16) u8 smem[kSmemBytes];
    if (ts.rows > 0) gate_partial(ts, gate, partials + static_cast<u64>(slice) * kTileTokens * kExperts, smem);
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this block's partial before its count
        last = atomicAdd(counter, 1u) + 1 == num_slices;
        if (last) *counter = 0;  // every block of the tile has counted: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other blocks' partials after their counts
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* row = reinterpret_cast<float*>(smem) + warp * kExperts;
    for (u32 t = warp; t < ts.rows; t += kWarps) {
        for (u32 e = lane; e < kExperts; e += 32) {
            float part[kMaxSlices];  // every load issued before the first add: one latency, not a chain
#pragma unroll
            for (u32 s = 0; s < kMaxSlices; ++s)
                part[s] = s < num_slices ? __ldcg(partials + (static_cast<u64>(s) * kTileTokens + t) * kExperts + e) : 0.0f;
            float sum = 0.0f;
#pragma unroll
            for (u32 s = 0; s < kMaxSlices; ++s)
                if (s < num_slices) sum += part[s];
            row[e] = sum;
            logits[t * kExperts + e] = sum;
        }
        __syncwarp();
        route_row(row, k, idx + t * k, w + t * k, lane);
        __syncwarp();
    }
    for (u32 i = ts.rows * k + threadIdx.x; i < (ts.rows + empty_rows) * k; i += kThreads) idx[i] = -1, w[i] = 0.0f;
}

__device__ TileSlice tile_slice(const float* hidden, u32 num_rows, u32 hidden_dim, u32 slice_k, u32 tile, u32 slice) {
    TileSlice ts;
    const u32 t0 = tile * kTileTokens;
    ts.rows = t0 < num_rows ? min(kTileTokens, num_rows - t0) : 0;
    ts.hidden = hidden + static_cast<u64>(t0) * hidden_dim;
    ts.hidden_dim = hidden_dim;
    ts.k_begin = slice * slice_k;
    ts.k_end = min(hidden_dim, ts.k_begin + slice_k);
    return ts;
}

// One thread per chunk of [first, first + count): wait until every consumer is done with the
// chunk's slot. A one-block launch ahead of each produce_chunks launch on the producer's stream,
// so the blocks that write slots never wait: a consumer that needs whole SMs (GEMMs) always
// finds them, and the wait holds one block, not a launch's worth.
// `timeout_ns`: the layer's own deadline (wait_timeout_ns(layer.timeout_s)), so a slot the layer
// never releases is reported on the same clock as the layer's waits.
extern "C" __global__ void wait_slots_free(const stream::StreamRing* ring_ptr, u32 first, u32 count, u64 timeout_ns) {
    const stream::StreamRing ring = *ring_ptr;
    for (u32 i = threadIdx.x; i < count; i += blockDim.x) {
        const u32 chunk = first + i;
        if (!stream::wait_slot_free(ring, chunk, timeout_ns)) {
            printf("megamoe_rt.routers: wait 'stream slot free' timed out after %.1f s: slot %u (chunk %u) was never "
                   "released by the layer\n", static_cast<double>(timeout_ns) * 1e-9, stream::slot_of(ring, chunk), chunk);
            __trap();
        }
    }
}

// Chunks [first_chunk, first_chunk + gridDim.z) of a call in one launch, grid
// (ceil(tokens_per_slot / kTileTokens), slices, chunks), after wait_slots_free for the same
// chunks: each chunk's gating product, routing and quantized activations straight into its
// slot, both halves published by the chunk's last block done. Blocks are dispatched in chunk
// order (z is the slowest grid dimension), so the first chunks publish while later ones are
// still being routed. `hidden` holds the launch's `n` rows from its first chunk's first token;
// a chunk's tokens past them get empty routes, so the slot describes itself. `slot_done`
// counts the blocks done with each slot in this call (zeroed at the call's start): a slot's
// k-th chunk of the call is complete once every block of a chunk has counted it k times.
// `partials` / `counters`: the launch's scratch (counters zero, and zero again after it).
// Five blocks an SM (48 registers, no spill at 8-384 experts; unbounded, ptxas spilled at some
// expert counts): a streamed call's consumer holds 64 x 256 registers on every SM, which
// leaves room for four of these beside it, as many as at 64 registers with the SM to itself.
extern "C" __global__ void __launch_bounds__(kThreads, 5) produce_chunks(const stream::StreamRing* ring_ptr,
                                                                      const float* hidden, const float* gate, u32 n,
                                                                      u32 first_chunk, u32 slice_k, u32* slot_done,
                                                                      float* logits, float* partials, u32* counters) {
    const stream::StreamRing ring = *ring_ptr;
    const u32 chunk = first_chunk + blockIdx.z;
    const u64 c0 = static_cast<u64>(blockIdx.z) * ring.tokens_per_slot;  // the chunk's first row in the launch
    const u32 chunk_rows = min(static_cast<u64>(ring.tokens_per_slot), n - c0);
    const TileSlice ts = tile_slice(hidden + c0 * ring.hidden, chunk_rows, ring.hidden, slice_k, blockIdx.x, blockIdx.y);
    const u64 t0 = static_cast<u64>(blockIdx.x) * kTileTokens;
    const u32 tile = blockIdx.z * gridDim.x + blockIdx.x;  // the tile's scratch in the launch
    quantize_slice(ts, stream::chunk_x(ring, chunk) + t0 * ring.hidden, stream::chunk_x_sf(ring, chunk) + t0 * (ring.hidden / 128));
    const u32 slot_rows = min(kTileTokens, ring.tokens_per_slot - static_cast<u32>(t0));
    gate_route_tile(ts, blockIdx.y, gridDim.y, gate, partials + static_cast<u64>(tile) * kTileTokens * gridDim.y * kExperts, counters + tile,
                    logits + (c0 + t0) * kExperts, ring.num_topk, stream::chunk_topk_idx(ring, chunk) + t0 * ring.num_topk,
                    stream::chunk_topk_weights(ring, chunk) + t0 * ring.num_topk, slot_rows - ts.rows);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // the block's payload before its count
        const u32 blocks = gridDim.x * gridDim.y;
        const u32 target = blocks * (chunk / ring.num_slots + 1);
        if (atomicAdd(slot_done + stream::slot_of(ring, chunk), 1u) + 1 == target) {
            const u32 epoch = stream::producer_epoch(ring);
            stream::publish_route(ring, epoch, chunk);
            stream::publish_layout(ring, epoch, chunk);
        }
    }
}

// The batch call's inputs, every token at once, grid (ceil(T / kTileTokens), slices): the same
// logits, routes and quantized activations the chunks of a streamed call get.
extern "C" __global__ void __launch_bounds__(kThreads) route_batch(const float* hidden, const float* gate,
                                                                   u32 num_tokens, u32 hidden_dim, u32 slice_k, u32 k,
                                                                   i32* idx, float* w, u8* x, float* x_sf,
                                                                   float* logits, float* partials, u32* counters) {
    const TileSlice ts = tile_slice(hidden, num_tokens, hidden_dim, slice_k, blockIdx.x, blockIdx.y);
    const u64 t0 = static_cast<u64>(blockIdx.x) * kTileTokens;
    quantize_slice(ts, x + t0 * hidden_dim, x_sf + t0 * (hidden_dim / 128));
    gate_route_tile(ts, blockIdx.y, gridDim.y, gate, partials + t0 * gridDim.y * kExperts, counters + blockIdx.x,
                    logits + t0 * kExperts, k, idx + t0 * k, w + t0 * k, 0);
}

// Routing only, from given logits [T, kExperts]: a warp per token.
extern "C" __global__ void __launch_bounds__(kThreads) route_all(const float* logits, u32 num_tokens, u32 k, i32* idx,
                                                                 float* w) {
    const u32 token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (token < num_tokens)
        route_row(logits + static_cast<u64>(token) * kExperts, k, idx + static_cast<u64>(token) * k,
                  w + static_cast<u64>(token) * k, threadIdx.x % 32);
}
"""


def slice_k(hidden: int) -> int:
    """Hidden elements per slice of the router's gating product (at most 16 slices, whole
    128-element groups): a function of the hidden size only, so a token's logits are summed the
    same way in a chunk and in a whole call."""
    groups = hidden // 128
    return -(-groups // MAX_SLICES) * 128


# Slices of the hidden dimension in the router's gating product (the kernels' kMaxSlices).
MAX_SLICES = 16

# Experts a router routes: the last block of a tile holds a token's logits per warp in shared memory.
MAX_EXPERTS = 1024

# Tokens of one batch-routing launch (Router.route_batch): bounds its scratch.
BATCH_TOKENS = 8192

# Tokens of a router block's tile (the kernels' kTileTokens, set through router_options()).
TILE_TOKENS = 32


def chunks_per_launch(num_slots: int, tokens_per_slot: int) -> int:
    """Chunks a streaming router launch covers: a round of the ring (no chunk of a launch waits
    for another's slot), at most BATCH_TOKENS tokens (the scratch) unless one chunk is more."""
    return max(1, min(num_slots, BATCH_TOKENS // tokens_per_slot))


def launch_grid(rows: int, hidden: int) -> tuple[int, int]:
    """A router launch's grid over ``rows`` tokens: token tiles x slices of the hidden dimension."""
    return -(-rows // TILE_TOKENS), -(-hidden // slice_k(hidden))


def router_options(num_experts: int) -> list[str]:
    """NVRTC options of the router module built for ``num_experts`` logits per token."""
    return [
        *producer_options(),
        f"-DROUTER_EXPERTS={num_experts}",
        f"-DROUTER_TILE_TOKENS={TILE_TOKENS}",
        f"-DROUTER_MAX_SLICES={MAX_SLICES}",
    ]


class Router:
    """The router of ``layer`` (a streamed layer, or None for whole-call routing only):
    ``num_experts`` logits per token from a float32 gating product, the top ``num_topk``.

    The gating product runs inside the router's own kernels (tiles of 32 tokens, the hidden
    dimension cut into at most 16 slices, one block per tile and slice; the last block of a tile
    adds the slices in order, routes the tile and the blocks quantize their slices), so a round
    of the ring costs one launch (and a one-block wait for its slots), and a token's logits are
    the same bits in a streamed chunk and in the batch call. Each call takes its own scratch from CuPy's pool on the stream it runs on, so
    calls on different streams do not share it."""

    def __init__(self, num_experts: int, num_topk: int, layer: Any = None):
        # Checked before CuPy is imported or anything compiled: the counts are compiled into
        # the kernels and size their launches.
        num_experts = arg_checks.integer("num_experts", num_experts)
        num_topk = arg_checks.integer("num_topk", num_topk)
        if not 1 <= num_experts <= MAX_EXPERTS:
            raise ValueError(
                f"num_experts={num_experts}: expected 1..{MAX_EXPERTS} (a token's logits are routed from shared memory)"
            )
        if not 1 <= num_topk <= num_experts:
            raise ValueError(f"num_topk={num_topk}: expected 1..num_experts={num_experts}")
        if layer is not None:
            if getattr(layer, "streaming", None) is None:
                raise ValueError(
                    f"layer: expected a layer built with streaming=StreamConfig(...) or None, got {type(layer).__name__} "
                    "without an input ring"
                )
            for name, mine in (("num_experts", num_experts), ("num_topk", num_topk)):
                theirs = getattr(layer, name, None)
                if theirs != mine:
                    raise ValueError(
                        f"{name}={mine}: expected the layer's {name}={theirs} (the router fills its input ring)"
                    )
        import cupy as cp

        self.cp, self.num_experts, self.num_topk, self.layer = cp, num_experts, num_topk, layer
        module = cp.RawModule(code=ROUTER, options=tuple(router_options(num_experts)))
        # get_function loads each kernel now, not at its first launch (see produce()).
        names = ("wait_slots_free", "produce_chunks", "route_batch", "route_all")
        kernels = [module.get_function(n) for n in names]
        self._wait_slots_free, self._produce_chunks, self._route_batch, self._route_all = kernels
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
            args = (logits, np.uint32(t), np.uint32(self.num_topk), topk_idx, topk_weights)
            self._route_all((-(-t // 8),), (256,), args)

    def route_batch(self, hidden: Any, gate: Any) -> tuple[Any, Any, Any, Any, Any]:
        """A whole call's layer inputs on CuPy's current stream: ``(x, x_sf, topk_idx,
        topk_weights, logits)`` for ``hidden`` (float32 ``[T, H]``) and ``gate`` (float32
        ``[H, E]``), the bits a streamed call's chunks get (``x`` / ``x_sf`` are what
        ``quantize_fp8(hidden)`` gives). One launch per BATCH_TOKENS tokens, which bounds the
        scratch of partial products (16 x E floats a token at most)."""
        cp = self.cp
        self._check_inputs(hidden, gate)
        t, h = hidden.shape
        k = self.num_topk
        x, x_sf = cp.empty((t, h), cp.uint8), cp.empty((t, h // 128), cp.float32)
        idx, w = cp.empty((t, k), cp.int32), cp.empty((t, k), cp.float32)
        logits = cp.empty((t, self.num_experts), cp.float32)
        if t:
            rows = min(t, BATCH_TOKENS)
            partials, counters = self._scratch(*launch_grid(rows, h))  # shared by the launches: they run in turn
            sk = np.uint32(slice_k(h))
            for t0 in range(0, t, rows):
                n = min(rows, t - t0)
                grid = launch_grid(n, h)
                outs = (idx[t0:], w[t0:], x[t0:], x_sf[t0:], logits[t0:])
                args = (hidden[t0:], gate, np.uint32(n), np.uint32(h), sk, np.uint32(k), *outs, partials, counters)
                self._route_batch(grid, (256,), args)
        return x, x_sf, idx, w, logits

    def _scratch(self, tiles: int, slices: int) -> tuple[Any, Any]:
        """Partial products and per-tile counters (zero; the kernels leave them zero) of a launch
        over ``tiles`` token tiles, from CuPy's pool on the current stream."""
        cp = self.cp
        partials = cp.empty(tiles * slices * TILE_TOKENS * self.num_experts, cp.float32)
        return partials, cp.zeros(tiles, cp.uint32)

    def warm(self, hidden: Any, gate: Any, stream: Any) -> None:
        """Run the router once on ``stream`` over a few of ``hidden``'s tokens and wait. A kernel
        whose first launch still has work to do (CUDA lazy loading) may wait for the context to
        go idle, which it never does while the layer spins on a chunk."""
        with stream:
            self.route_batch(hidden[:8], gate)
        stream.synchronize()

    def produce(self, hidden: Any, gate: Any, stream: Any) -> list[Any]:
        """A streamed call's inputs, chunk by chunk on ``stream``: the gating product of the call's
        ``hidden`` rows (float32 ``[T, H]``, C-contiguous) with ``gate`` (float32 ``[H, E]``), each
        chunk routed into its slot, its activations quantized there (the bytes ``quantize_fp8``
        gives) and both halves published as soon as the chunk is done. Returns the chunks'
        logits (for checking against :meth:`route_all`).

        One launch covers a round of the ring (``num_slots`` chunks, at most BATCH_TOKENS tokens),
        so no chunk of a launch waits for another chunk of it, and each launch's fixed cost (the
        last tiles' reduction and routing) overlaps the next chunks' products instead of adding up
        chunk by chunk. A one-block launch ahead of each round waits for the round's slots: the
        blocks that write slots never wait, so they never hold SMs a consumer needs."""
        cp = self.cp
        cfg, t = self.config, hidden.shape[0]
        self._check_inputs(hidden, gate, self._ring.layout.hidden)
        c = cfg.tokens_per_slot
        if t > self.layer.num_max_tokens_per_rank:
            raise ValueError(f"hidden: {t} tokens, more than the layer's capacity {self.layer.num_max_tokens_per_rank}")
        h = hidden.shape[1]
        sk = np.uint32(slice_k(h))
        num_chunks = cfg.num_chunks(t)
        per_launch = chunks_per_launch(cfg.num_slots, c)
        tiles, slices = launch_grid(c, h)
        timeout_ns = np.uint64(wait_timeout_ns(self.layer.timeout_s))
        with stream:
            logits = cp.empty((t, self.num_experts), cp.float32)
            partials, counters = self._scratch(
                min(per_launch, max(num_chunks, 1)) * tiles, slices
            )  # launches run in turn
            self._ring.begin_call(stream.ptr)
            self._slot_done.fill(0)
            for first in range(0, num_chunks, per_launch):
                count = min(per_launch, num_chunks - first)
                self._wait_slots_free((1,), (32,), (self._ring_dev, np.uint32(first), np.uint32(count), timeout_ns))
                rows = min(t - first * c, count * c)
                args = (
                    self._ring_dev,
                    hidden[first * c :],
                    gate,
                    np.uint32(rows),
                    np.uint32(first),
                    sk,
                    self._slot_done,
                )
                self._produce_chunks((tiles, slices, count), (256,), (*args, logits[first * c :], partials, counters))
        return [logits[i * c : i * c + cfg.chunk_tokens(t, i)] for i in range(num_chunks)]
