// Routing: count the (token, slot) pairs of every local expert, then lay the
// experts out in the pool (block-aligned exclusive scan) and reset the dispatch
// cursors. Two launches on the caller's stream; nothing reaches the host.

#include "common/types.cuh"
#include "moe/params.cuh"
#include "moe/route_count.cuh"

namespace megamoe_rt::moe {

// Block-local histogram in shared memory, then one global atomic per expert and block.
template <typename IdxT>
__global__ void __launch_bounds__(kCountThreads) moe_count_routes(const __grid_constant__ MoeParams p) {
    __shared__ i32 hist[kMaxLocalExperts];
    count_pairs<kCountThreads>(hist, p.num_local_experts, p.num_tokens * p.num_topk, p.expert_counts,
                               [&p](u32 pair) { return local_expert<IdxT>(p, pair); });
}

static_assert(kScanThreads >= kMaxLocalExperts, "the scan gives every local expert a thread");

// One block: offsets[e] = sum over e' < e of align(count[e'], pool_align).
__global__ void __launch_bounds__(kScanThreads) moe_pool_offsets(const __grid_constant__ MoeParams p) {
    __shared__ i32 scan[kScanThreads];
    const u32 e = threadIdx.x;
    i32 count = e < p.num_local_experts ? p.expert_counts[e] : 0;
    const i32 align = static_cast<i32>(p.pool_align);
    const i32 padded = (count + align - 1) / align * align;
    scan[e] = padded;
    block_inclusive_scan<kScanThreads>(scan);  // the experts fit one block (checked on the host)
    // The host's checks keep the pool within the worst case; should it still be exceeded, it is
    // reported and every expert left empty, so that no dispatch, window fill or GEMM tile
    // touches rows past the per-row metadata (the cross-rank layout does the same).
    const u32 laid_out = static_cast<u32>(scan[kScanThreads - 1]);
    const bool overflow = laid_out > p.pool_row_limit;
    if (overflow) count = 0;
    if (e < p.num_local_experts) {
        store_expert_range(p, e, overflow ? 0 : scan[e] - padded, count);
        p.expert_cursors[e] = 0;
    }
    if (e == p.num_local_experts - 1) {
        p.expert_offsets[p.num_local_experts] = overflow ? 0 : scan[e];
        if (overflow) errors::report_error(p.errors, errors::ErrorKind::kPoolOverflow, laid_out, p.pool_row_limit);
        if (p.pool_cycles != nullptr) *p.pool_cycles = pool_cycles(p, overflow ? 0u : laid_out);
    }
}

}  // namespace megamoe_rt::moe
