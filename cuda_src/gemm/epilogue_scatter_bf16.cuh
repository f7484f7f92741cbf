// The bf16 scatter the combine uses: each row of D goes to its own byte address
// row_dst[row], local or a peer's; 0 drops the row.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/tile_scheduler.cuh"
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

struct ScatterBf16Epilogue {
    template <class Cfg>
    static __device__ __forceinline__ void store(const GemmParams& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& /*sm*/, const float (&out)[64]) {
        const u32 col0 = mt.col0(tile);
        // Rows may go to a peer over NVLink, where small writes waste the link: each lane
        // stores 16 bytes, so a quad writes 64 contiguous bytes of its row (4 bytes before).
        const u32 q = mt.lane % 4;
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 r = mt.row0 + 8 * half;
            // Plain load: in the fused kernel these addresses are written earlier in the same launch.
            u8* base = r < tile.rows ? reinterpret_cast<u8*>(p.row_dst[tile.row0 + r]) : nullptr;
#pragma unroll
            for (u32 g0 = 0; g0 < 16; g0 += 4) {
                u32 v[4];
#pragma unroll
                for (u32 k = 0; k < 4; ++k)
                    v[k] = ptx::cvt_rn_bf16x2_f32(out[4 * (g0 + k) + 2 * half], out[4 * (g0 + k) + 2 * half + 1]);
                const ptx::u32x4 run = quad_transpose_b32(v, q);
                if (base != nullptr) ptx::st_global_v4_b32(base + 2ull * (col0 + 8 * (g0 + q)), run);
            }
        }
    }
};

}  // namespace megamoe_rt::gemm
