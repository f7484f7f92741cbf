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
//
// Two butterfly rounds, written with selects only: the word a lane sends and the slot it fills
// depend on its lane bits, and an index that depends on the lane would compile to branches
// (which, with wgmma in flight, is what ptxas must not be given). Round one (lanes q, q ^ 2)
// swaps the off-diagonal 2 x 2 blocks of the quad's 4 x 4 matrix of words, round two (lanes
// q, q ^ 1) the off-diagonal words of each block.
//
// One exchange of a round: the lanes paired by `mask` trade a word, the lower lane giving `b`
// and taking the upper lane's `a` into it.
__device__ __forceinline__ void exchange_across(u32& a, u32& b, bool upper, u32 mask) {
    const u32 received = __shfl_xor_sync(0xFFFFFFFFu, upper ? a : b, mask);
    a = upper ? received : a;
    b = upper ? b : received;
}

__device__ __forceinline__ ptx::u32x4 quad_transpose_b32(const u32 (&v)[4], u32 q) {
    u32 w0 = v[0], w1 = v[1], w2 = v[2], w3 = v[3];
    const bool hi2 = (q & 2) != 0, hi1 = (q & 1) != 0;
    exchange_across(w0, w2, hi2, 2);
    exchange_across(w1, w3, hi2, 2);
    exchange_across(w0, w1, hi1, 1);
    exchange_across(w2, w3, hi1, 1);
    return {w0, w1, w2, w3};  // lane k's word of group g0 + q, k = 0..3
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
