// Kernels of the chunk-ready input ring (the protocol: producer.cuh; the model:
// megamoe_rt/schedule/streaming.py).
//
// Producer side, for callers without kernels of their own (megamoe_rt.streaming.ChunkWriter),
// per call: stream_begin_call; per chunk: stream_wait_slot_free -> stream_copy_chunk ->
// stream_publish_chunk, on the writer's stream (kernel boundaries order the copy before the
// publish).
//
// Consumer side, the layer, per call: stream_begin_consume; per chunk: stream_wait_chunk before
// its first read of the slot, stream_release_chunk after its last (across ranks: after every
// rank's last read, which the layer's cross-rank barrier of the chunk establishes).

#include "common/types.cuh"
#include "interface/stream.cuh"
#include "ptx/ld_st.cuh"
#include "stream/producer.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::stream {

constexpr u32 kCopyThreads = 256;

__global__ void stream_begin_call(const __grid_constant__ RingChunkParams p) {
    if (threadIdx.x == 0) atomicAdd(p.ring.producer_epoch, 1u);
}

__global__ void stream_wait_slot_free(const __grid_constant__ RingChunkParams p) {
    if (threadIdx.x != 0) return;
    const u32 slot = slot_of(p.ring, p.chunk);
    sync::wait_ge_acquire_sys_u64(p.ring.consumed_gen + slot, last_published(p.ring, slot),
                                  sync::WaitSite::kStreamSlotFree, p.wait, slot);
}

// The call's ids may be int64 (what a framework's top-k returns); the slot holds int32. An id
// outside int32 is saturated, so the consumer refuses and reports it as the batch call does.
__device__ __forceinline__ i32 call_expert_id(const RingChunkParams& p, u64 i) {
    if (p.topk_idx_bytes == 8) {
        const i64 id = static_cast<const i64*>(p.topk_idx)[i];
        return static_cast<i32>(id < -0x80000000ll ? -0x80000000ll : (id > 0x7fffffffll ? 0x7fffffffll : id));
    }
    return static_cast<const i32*>(p.topk_idx)[i];
}

// A warp per token of the chunk: its x row, scales and routing into the slot. Tokens past the
// call's end (the last chunk may be partial) get empty routing, so the slot describes itself.
__global__ void __launch_bounds__(kCopyThreads) stream_copy_chunk(const __grid_constant__ RingChunkParams p) {
    const StreamRing& r = p.ring;
    const u32 lane = threadIdx.x % 32;
    const u32 warps = gridDim.x * (kCopyThreads / 32);
    const u32 sf_cols = r.hidden / 128;
    u8* x = chunk_x(r, p.chunk);
    float* x_sf = chunk_x_sf(r, p.chunk);
    i32* idx = chunk_topk_idx(r, p.chunk);
    float* w = chunk_topk_weights(r, p.chunk);
    for (u32 t = (blockIdx.x * kCopyThreads + threadIdx.x) / 32; t < r.tokens_per_slot; t += warps) {
        const u64 token = static_cast<u64>(p.chunk) * r.tokens_per_slot + t;
        const bool real = token < p.num_tokens;
        if (real) {
            const ptx::u32x4* src = reinterpret_cast<const ptx::u32x4*>(p.x + token * r.hidden);
            ptx::u32x4* dst = reinterpret_cast<ptx::u32x4*>(x + static_cast<u64>(t) * r.hidden);
            for (u32 v = lane; v < r.hidden / 16; v += 32) dst[v] = ptx::ld_global_nc_v4_u32(src + v);
            for (u32 j = lane; j < sf_cols; j += 32)
                x_sf[static_cast<u64>(t) * sf_cols + j] = p.x_sf[token * sf_cols + j];
        }
        for (u32 k = lane; k < r.num_topk; k += 32) {
            idx[static_cast<u64>(t) * r.num_topk + k] = real ? call_expert_id(p, token * r.num_topk + k) : -1;
            w[static_cast<u64>(t) * r.num_topk + k] = real ? p.topk_weights[token * r.num_topk + k] : 0.0f;
        }
    }
}

__global__ void stream_publish_chunk(const __grid_constant__ RingChunkParams p) {
    if (threadIdx.x != 0) return;
    const u32 epoch = producer_epoch(p.ring);
    publish_route(p.ring, epoch, p.chunk);
    publish_layout(p.ring, epoch, p.chunk);
}

__global__ void stream_begin_consume(const __grid_constant__ RingChunkParams p) {
    if (threadIdx.x == 0) atomicAdd(p.ring.consumer_epoch, 1u);
}

// One thread: both halves of the chunk are the current call's (its epoch counted by
// stream_begin_consume). A slot cannot hold a newer generation: its producer waits for this
// chunk's release first.
__global__ void stream_wait_chunk(const __grid_constant__ RingChunkParams p) {
    if (threadIdx.x != 0) return;
    const u32 slot = slot_of(p.ring, p.chunk);
    const u64 gen = generation(ptx::ld_acquire_gpu_u32(p.ring.consumer_epoch), p.chunk);
    sync::wait_ge_acquire_sys_u64(p.ring.route_ready_gen + slot, gen, sync::WaitSite::kStreamRouteReady, p.wait, slot);
    sync::wait_ge_acquire_sys_u64(p.ring.layout_ready_gen + slot, gen, sync::WaitSite::kStreamLayoutReady, p.wait,
                                  slot);
}

// One thread, after the layer's last read of the chunk (earlier kernels on this stream).
__global__ void stream_release_chunk(const __grid_constant__ RingChunkParams p) {
    if (threadIdx.x != 0) return;
    const u32 slot = slot_of(p.ring, p.chunk);
    ptx::fence_acq_rel_sys();
    ptx::st_release_sys_u64(p.ring.consumed_gen + slot,
                            generation(ptx::ld_acquire_gpu_u32(p.ring.consumer_epoch), p.chunk));
}

}  // namespace megamoe_rt::stream
