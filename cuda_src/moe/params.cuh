// Device helpers over the parameters of the routing, dispatch and combine kernels. MoeParams,
// ErrorFlags and the limits are declared in megamoe_rt/kernels/interface/moe.py (generated
// into interface/moe.cuh); the host resolves every pointer and stride from the buffer layout.
#pragma once

#include "common/types.cuh"
#include "interface/moe.cuh"

namespace megamoe_rt::moe {

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
