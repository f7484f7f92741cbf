// Warp-wide prefix sums, for the scans over per-expert counts that one warp does alone.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt {

// Inclusive prefix sum of `value` over the lanes of a full warp (every lane must call it).
__device__ __forceinline__ u32 warp_inclusive_sum(u32 value) {
    const u32 lane = threadIdx.x % 32;
#pragma unroll
    for (u32 d = 1; d < 32; d *= 2) {
        const u32 v = __shfl_up_sync(0xFFFFFFFFu, value, d);
        if (lane >= d) value += v;
    }
    return value;
}

}  // namespace megamoe_rt
