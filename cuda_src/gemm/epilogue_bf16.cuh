// The plain bf16 epilogue: D rows, row-major, to d + row * d_row_stride_bytes.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/quad_transpose.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

// One of the thread's rows (`half`: row0 or row0 + 8) as bf16, every pass's columns, to the row
// at `base` when `keep` (every lane shuffles, rows past the tile's end included). Each lane
// stores 16 bytes (a quad writes 64 contiguous bytes of its row): a quarter of the store
// instructions of one 4-byte pair per lane, which queued in the LSU while the tensor pipe waited
// for the next tile (the epilogue's LG-throttle stalls, bench/NOTES.md); over NVLink (the
// scatter) small writes would also waste the link. Shared by both bf16 epilogues.
template <class Cfg>
__device__ __forceinline__ void store_bf16_row(u8* base, bool keep, const PromotedSums<Cfg>& out,
                                               const MathThread<Cfg>& mt, const Tile& tile, u32 half) {
    const u32 q = mt.lane % 4;
#pragma unroll
    for (u32 pass = 0; pass < Cfg::kNPasses; ++pass) {
        const u32 col0 = mt.on_pass(pass).col0(tile);
#pragma unroll
        for (u32 g0 = 0; g0 < 16; g0 += 4) {
            const ptx::u32x4 run = bf16_row_run(pass_sums<Cfg>(out, pass), half, g0, q);
            if (keep) ptx::st_global_v4_b32(base + 2ull * (col0 + 8 * (g0 + q)), run);
        }
    }
}

struct StoreBf16Epilogue {
    using Params = StoreBf16Params;

    template <class Cfg>
    static __device__ __forceinline__ void store(const Params& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& /*sm*/, const PromotedSums<Cfg>& out) {
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 r = mt.row0 + 8 * half;
            u8* base = p.d + static_cast<u64>(tile.d_row0 + r) * p.d_row_stride_bytes;
            store_bf16_row<Cfg>(base, r < tile.rows, out, mt, tile, half);
        }
    }
};

}  // namespace megamoe_rt::gemm
