// The bf16 scatter the combine uses: each row of D goes to its own byte address
// row_dst[row], local or a peer's; 0 drops the row.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/quad_transpose.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

struct ScatterBf16Epilogue {
    template <class Cfg>
    static __device__ __forceinline__ void store(const GemmParams& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& /*sm*/, const PromotedSums<Cfg>& out) {
        // Rows may go to a peer over NVLink, where small writes waste the link: each lane
        // stores 16 bytes, so a quad writes 64 contiguous bytes of its row (4 bytes before).
        const u32 q = mt.lane % 4;
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 r = mt.row0 + 8 * half;
            // Plain load: in the fused kernel these addresses are written earlier in the same launch.
            u8* base = r < tile.rows ? reinterpret_cast<u8*>(p.row_dst[tile.row0 + r]) : nullptr;
#pragma unroll
            for (u32 pass = 0; pass < Cfg::kNPasses; ++pass) {
                const u32 col0 = mt.on_pass(pass).col0(tile);
#pragma unroll
                for (u32 g0 = 0; g0 < 16; g0 += 4) {
                    const ptx::u32x4 run = bf16_row_run(pass_sums<Cfg>(out, pass), half, g0, q);
                    if (base != nullptr) ptx::st_global_v4_b32(base + 2ull * (col0 + 8 * (g0 + q)), run);
                }
            }
        }
    }
};

}  // namespace megamoe_rt::gemm
