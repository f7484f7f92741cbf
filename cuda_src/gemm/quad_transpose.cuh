// Register transposes of the wgmma accumulator layout for wide stores.
#pragma once

#include "common/types.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

// A quad (lanes 4i..4i+3, one accumulator row) holds column groups g0..g0+3 as bf16 pairs,
// lane q the pair at columns 2q, 2q + 1 of each group (v[k] for group g0 + k). Transposed,
// lane q holds group g0 + q whole: 8 consecutive columns, one 16-byte store. Every lane of
// the warp must call (the shuffles take the full mask).
__device__ __forceinline__ ptx::u32x4 quad_transpose_b32(const u32 (&v)[4], u32 q) {
    auto pick = [&](u32 k) { return k == 0 ? v[0] : k == 1 ? v[1] : k == 2 ? v[2] : v[3]; };
    // Lane q ^ r sends what lane q needs from it: its pair of group g0 + q.
    const u32 from1 = __shfl_xor_sync(0xFFFFFFFFu, pick(q ^ 1), 1);
    const u32 from2 = __shfl_xor_sync(0xFFFFFFFFu, pick(q ^ 2), 2);
    const u32 from3 = __shfl_xor_sync(0xFFFFFFFFu, pick(q ^ 3), 3);
    auto pair_of_lane = [&](u32 k) {
        const u32 r = q ^ k;
        return r == 0 ? pick(q) : r == 1 ? from1 : r == 2 ? from2 : from3;
    };
    return {pair_of_lane(0), pair_of_lane(1), pair_of_lane(2), pair_of_lane(3)};
}

// The 16 bytes lane q of a quad stores of one of its rows (`half`: row0 or row0 + 8): column
// groups g0..g0+3 of the promoted sums as bf16, transposed so the lane holds group g0 + q whole.
__device__ __forceinline__ ptx::u32x4 bf16_row_run(const float (&out)[64], u32 half, u32 g0, u32 q) {
    u32 v[4];
#pragma unroll
    for (u32 k = 0; k < 4; ++k)
        v[k] = ptx::cvt_rn_bf16x2_f32(out[4 * (g0 + k) + 2 * half], out[4 * (g0 + k) + 2 * half + 1]);
    return quad_transpose_b32(v, q);
}

}  // namespace megamoe_rt::gemm
