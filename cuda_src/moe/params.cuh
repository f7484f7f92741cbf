// Device helpers over the parameters of the routing, dispatch and combine kernels. MoeParams
// and the limits are declared in megamoe_rt/kernels/interface/moe.py (generated into
// interface/moe.cuh); the host resolves every pointer and stride from the buffer layout.
#pragma once

#include "common/error_report.cuh"
#include "common/types.cuh"
#include "interface/moe.cuh"

namespace megamoe_rt::moe {

template <typename IdxT>
__device__ __forceinline__ i64 load_expert_id(const MoeParams& p, u32 pair) {
    return static_cast<i64>(static_cast<const IdxT*>(p.topk_idx)[pair]);
}

// The global expert a pair is routed to, or -1. Empty slots are -1; so are refused ones, which
// are reported: an id outside [-1, num_experts), and an id an earlier slot of the same token
// already names (the first occurrence is kept). Every kernel classifies a pair through this
// one function, so all of them drop the same pairs.
template <typename IdxT>
__device__ __forceinline__ i32 routed_expert(const MoeParams& p, u32 pair, bool report = true) {
    const i64 id = load_expert_id<IdxT>(p, pair);
    const u32 call_pair = p.token_base * p.num_topk + pair;  // reports name the call's pair
    if (id == -1) return -1;
    if (id < -1 || id >= static_cast<i64>(p.num_experts)) {
        // The id itself, saturated to 32 bits (the host reads it back as a signed number).
        const i64 shown = id < -0x80000000ll ? -0x80000000ll : (id > 0x7fffffffll ? 0x7fffffffll : id);
        if (report)
            errors::report_error(p.errors, errors::ErrorKind::kExpertIdOutOfRange, call_pair, static_cast<u32>(shown));
        return -1;
    }
    // No early exit: the loads are independent, so they are all in flight at once instead of
    // one latency per earlier slot.
    bool repeated = false;
#pragma unroll 4
    for (u32 q = pair - pair % p.num_topk; q < pair; ++q) repeated |= load_expert_id<IdxT>(p, q) == id;
    if (repeated) {
        if (report)
            errors::report_error(p.errors, errors::ErrorKind::kRepeatedExpertId, call_pair, static_cast<u32>(id));
        return -1;
    }
    return static_cast<i32>(id);
}

// Global expert of a pair, or -1 for empty and refused slots.
template <typename IdxT>
__device__ __forceinline__ i32 global_expert(const MoeParams& p, u32 pair) {
    return routed_expert<IdxT>(p, pair);
}

// Local expert of a pair, or -1 for empty and refused slots and other ranks' experts.
template <typename IdxT>
__device__ __forceinline__ i32 local_expert(const MoeParams& p, u32 pair) {
    const i32 id = routed_expert<IdxT>(p, pair);
    if (id < 0) return -1;
    const i64 local = static_cast<i64>(id) - static_cast<i64>(p.first_local_expert);
    return (local >= 0 && local < static_cast<i64>(p.num_local_experts)) ? static_cast<i32>(local) : -1;
}

// Local expert `e`'s range in the laid-out pool: its first row and its row count, and the
// count added to the running statistics. Every routing step that lays the experts out ends here.
__device__ __forceinline__ void store_expert_range(const MoeParams& p, u32 e, i32 first, i32 count) {
    p.expert_offsets[e] = first;
    p.expert_counts[e] = count;
    if (p.expert_recv_stats != nullptr) p.expert_recv_stats[e] += count;
}

// Cycles of a pool of `laid_out` rows through data regions of pool_rows rows; an empty pool
// still takes one (megamoe_rt/schedule/plan.py, num_cycles).
__device__ __forceinline__ u32 pool_cycles(const MoeParams& p, u32 laid_out) {
    return laid_out == 0 ? 1u : (laid_out + p.pool_rows - 1) / p.pool_rows;
}

// The local expert whose pool range holds `row` (the last one starting at or before it;
// expert_offsets is non-decreasing).
__device__ __forceinline__ u32 expert_of_row(const MoeParams& p, u32 row) {
    u32 lo = 0, hi = p.num_local_experts;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (static_cast<u32>(p.expert_offsets[mid]) <= row)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

}  // namespace megamoe_rt::moe
