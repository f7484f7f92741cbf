// The plain bf16 epilogue: D rows, row-major, to d + row * d_row_stride_bytes.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/quad_transpose.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

struct StoreBf16Epilogue {
    template <class Cfg>
    static __device__ __forceinline__ void store(const GemmParams& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& /*sm*/, const PromotedSums<Cfg>& out) {
        // Each lane stores 16 bytes (a quad writes 64 contiguous bytes of its row): a quarter of
        // the store instructions of one 4-byte pair per lane, which queued in the LSU while the
        // tensor pipe waited for the next tile (the epilogue's LG-throttle stalls, bench/NOTES.md).
        const u32 q = mt.lane % 4;
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 r = mt.row0 + 8 * half;
            u8* base = p.d + static_cast<u64>(tile.d_row0 + r) * p.d_row_stride_bytes;
            const bool keep = r < tile.rows;
#pragma unroll
            for (u32 pass = 0; pass < Cfg::kNPasses; ++pass) {
                const u32 col0 = mt.on_pass(pass).col0(tile);
#pragma unroll
                for (u32 g0 = 0; g0 < 16; g0 += 4) {
                    // Every lane shuffles, rows past the tile's end included; only rows in it store.
                    const ptx::u32x4 run = bf16_row_run(pass_sums<Cfg>(out, pass), half, g0, q);
                    if (keep) ptx::st_global_v4_b32(base + 2ull * (col0 + 8 * (g0 + q)), run);
                }
            }
        }
    }
};

}  // namespace megamoe_rt::gemm
