// The producer side of the chunk-ready input ring, for kernels outside megamoe_rt (a router, a
// layout kernel) that write a layer call's inputs chunk by chunk while the layer consumes them.
// Include it from NVRTC or CuPy RawKernel code with the options
// megamoe_rt.streaming.producer_options() gives (the include path of this tree, C++17).
//
// A call's chunk c lives in slot c % num_slots (StreamRing, interface/stream.cuh). Per chunk:
//
//   1. one thread: wait_slot_free(ring, chunk, timeout_ns) -- every consumer is done with what
//      was last published in the slot (or it was never used);
//   2. all writers: fill chunk_topk_idx / chunk_topk_weights and chunk_x / chunk_x_sf;
//   3. one thread, after every writer's stores are ordered before it (a __syncthreads() in a
//      one-block writer, or a kernel boundary): publish_route(...) and publish_layout(...) with
//      the call's epoch (producer_epoch(ring), read after the call's stream_begin_call).
//
// The two halves may be published by different kernels in either order; the layer reads a slot
// once both generations are the chunk's. A generation is (epoch << 32) | (chunk + 1), so what a
// previous call or CUDA-graph replay left in a slot never matches the current call's.
//
// Progress: the layer waits for chunks on the GPU. Run producers on another stream than the
// layer (or enqueue them before the layer's call on the same stream), never after it on the
// same stream: the layer would wait for chunks queued behind itself until its deadline.
#pragma once

#include "common/types.cuh"
#include "interface/stream.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/special_regs.cuh"

namespace megamoe_rt::stream {

__device__ __forceinline__ u64 generation(u32 epoch, u32 chunk) {
    return (static_cast<u64>(epoch) << kEpochShift) | (static_cast<u64>(chunk) + 1);
}

__device__ __forceinline__ u32 slot_of(const StreamRing& r, u32 chunk) { return chunk % r.num_slots; }

// The payload of chunk `chunk`'s slot: token t of the chunk is row t of each.
__device__ __forceinline__ u8* chunk_x(const StreamRing& r, u32 chunk) {
    return r.x + static_cast<u64>(slot_of(r, chunk)) * r.tokens_per_slot * r.hidden;
}
__device__ __forceinline__ float* chunk_x_sf(const StreamRing& r, u32 chunk) {
    return r.x_sf + static_cast<u64>(slot_of(r, chunk)) * r.tokens_per_slot * (r.hidden / 128);
}
__device__ __forceinline__ i32* chunk_topk_idx(const StreamRing& r, u32 chunk) {
    return r.topk_idx + static_cast<u64>(slot_of(r, chunk)) * r.tokens_per_slot * r.num_topk;
}
__device__ __forceinline__ float* chunk_topk_weights(const StreamRing& r, u32 chunk) {
    return r.topk_weights + static_cast<u64>(slot_of(r, chunk)) * r.tokens_per_slot * r.num_topk;
}

// The epoch of the call being produced (stream_begin_call has counted it).
__device__ __forceinline__ u32 producer_epoch(const StreamRing& r) { return ptx::ld_acquire_sys_u32(r.producer_epoch); }

// The newest generation published in a slot (either half): what its consumers must be done with.
__device__ __forceinline__ u64 last_published(const StreamRing& r, u32 slot) {
    const u64 route = ptx::ld_acquire_sys_u64(r.route_ready_gen + slot);
    const u64 layout = ptx::ld_acquire_sys_u64(r.layout_ready_gen + slot);
    return route > layout ? route : layout;
}

// One thread: wait until every consumer is done with the slot of `chunk`. False once
// `timeout_ns` has passed without that (the caller reports and traps).
__device__ __forceinline__ bool wait_slot_free(const StreamRing& r, u32 chunk, u64 timeout_ns) {
    const u32 slot = slot_of(r, chunk);
    const u64 needed = last_published(r, slot);
    const u64 start = ptx::globaltimer_ns();
    u32 spins = 0;
    while (ptx::ld_acquire_sys_u64(r.consumed_gen + slot) < needed) {
        if ((++spins & 255u) == 0 && ptx::globaltimer_ns() - start > timeout_ns) return false;
    }
    return true;
}

// One thread, after the chunk's routing payload is written and ordered before it: the chunk's
// topk_idx / topk_weights are published to every consumer (system scope: peers read them).
__device__ __forceinline__ void publish_route(const StreamRing& r, u32 epoch, u32 chunk) {
    ptx::fence_acq_rel_sys();
    ptx::st_release_sys_u64(r.route_ready_gen + slot_of(r, chunk), generation(epoch, chunk));
}

// The same for the chunk's x / x_sf.
__device__ __forceinline__ void publish_layout(const StreamRing& r, u32 epoch, u32 chunk) {
    ptx::fence_acq_rel_sys();
    ptx::st_release_sys_u64(r.layout_ready_gen + slot_of(r, chunk), generation(epoch, chunk));
}

}  // namespace megamoe_rt::stream
