// Parameters of the routing, dispatch and combine kernels of one MoE layer call.
// Host mirror: megamoe_rt.kernels.moe.MoeParams (ctypes); every pointer and stride is
// resolved there from the buffer layout (megamoe_rt/layout.py).
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::moe {

struct MoeParams {
    const void* topk_idx;        // [num_tokens, num_topk], int32 or int64 global expert ids, -1 = empty
    const float* topk_weights;   // [num_tokens, num_topk]
    const u8* x;                 // [num_tokens, hidden] e4m3
    const float* x_sf;           // [num_tokens, hidden / 128]
    u32 num_tokens;
    u32 num_topk;
    u32 hidden;
    u32 num_experts;             // global
    u32 num_local_experts;
    u32 first_local_expert;      // global id of local expert 0
    u32 pool_rows;               // capacity of the expert pool
    u32 pool_align;              // each expert's rows start on a multiple of this
    u32 token_capacity;          // T of the combine buffer [K, T, hidden]
    u32 pad_;
    i32* expert_counts;          // [num_local_experts]
    i32* expert_offsets;         // [num_local_experts + 1]
    i32* expert_cursors;         // [num_local_experts]
    i32* expert_recv_stats;      // optional [num_local_experts], += counts every call
    u32* error_flags;            // ErrorFlags bits
    u8* pool;                    // [pool_rows, hidden] e4m3
    float* pool_sf;              // [hidden / 128, pool_rows]
    i32* pool_src;               // [pool_rows]: token * num_topk + slot
    float* pool_weight;          // [pool_rows]
    u64* pool_dst;               // [pool_rows]: byte address of the row's combine slot
    u8* combine;                 // [num_topk, token_capacity, hidden] bf16
    u16* y;                      // [num_tokens, hidden] bf16 bits
};

struct ErrorFlags {
    static constexpr u32 kExpertIdOutOfRange = 1u << 0;
    static constexpr u32 kPoolOverflow = 1u << 1;
};

template <typename IdxT>
__device__ __forceinline__ i64 load_expert_id(const MoeParams& p, u32 pair) {
    return static_cast<i64>(static_cast<const IdxT*>(p.topk_idx)[pair]);
}

// Global expert of a pair, or -1 for empty slots and (flagged) out-of-range ids.
template <typename IdxT>
__device__ __forceinline__ i32 global_expert(const MoeParams& p, u32 pair) {
    const i64 id = load_expert_id<IdxT>(p, pair);
    if (id == -1) return -1;
    if (id < -1 || id >= static_cast<i64>(p.num_experts)) {
        atomicOr(p.error_flags, ErrorFlags::kExpertIdOutOfRange);
        return -1;
    }
    return static_cast<i32>(id);
}

// Local expert of a routed id, or -1 for empty slots, other ranks' experts and
// (flagged) out-of-range ids.
template <typename IdxT>
__device__ __forceinline__ i32 local_expert(const MoeParams& p, u32 pair) {
    const i64 id = load_expert_id<IdxT>(p, pair);
    if (id == -1) return -1;
    if (id < -1 || id >= static_cast<i64>(p.num_experts)) {
        atomicOr(p.error_flags, ErrorFlags::kExpertIdOutOfRange);
        return -1;
    }
    const i64 local = id - static_cast<i64>(p.first_local_expert);
    return (local >= 0 && local < static_cast<i64>(p.num_local_experts)) ? static_cast<i32>(local) : -1;
}

}  // namespace megamoe_rt::moe
