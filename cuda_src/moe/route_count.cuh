// Pieces the routing kernels share: a per-block histogram of (token, slot) pairs and a
// one-block inclusive scan.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::moe {

// Adds the pairs of each bin into `global_counts`, through a shared-memory histogram of
// `num_bins` entries (one global atomic per bin and block). `bin_of(pair)` returns -1 for
// pairs that count nowhere. Called by every thread of the block.
template <u32 kThreads, class BinOf>
__device__ __forceinline__ void count_pairs(i32* hist, u32 num_bins, u32 pairs, i32* global_counts, BinOf bin_of) {
    for (u32 b = threadIdx.x; b < num_bins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (u32 i = blockIdx.x * kThreads + threadIdx.x; i < pairs; i += gridDim.x * kThreads) {
        const i32 b = bin_of(i);
        if (b >= 0) atomicAdd(&hist[b], 1);
    }
    __syncthreads();
    for (u32 b = threadIdx.x; b < num_bins; b += kThreads)
        if (hist[b]) atomicAdd(&global_counts[b], hist[b]);
}

// Hillis-Steele inclusive scan of scan[0 .. kThreads) by a block of kThreads threads; the
// caller has written its own entry (thread i writes scan[i]) and reads after it returns.
template <u32 kThreads>
__device__ __forceinline__ void block_inclusive_scan(i32* scan) {
    const u32 e = threadIdx.x;
    __syncthreads();
    for (u32 step = 1; step < kThreads; step *= 2) {
        const i32 v = e >= step ? scan[e - step] : 0;
        __syncthreads();
        scan[e] += v;
        __syncthreads();
    }
}

}  // namespace megamoe_rt::moe
