// The plain bf16 epilogue: D rows, row-major, to d + row * d_row_stride_bytes.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

struct StoreBf16Epilogue {
    template <class Cfg>
    static __device__ __forceinline__ void store(const GemmParams& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& /*sm*/, const float (&out)[64]) {
        const u32 col0 = mt.col0(tile);
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 r = mt.row0 + 8 * half;
            if (r >= tile.rows) continue;
            u8* base = p.d + static_cast<u64>(tile.d_row0 + r) * p.d_row_stride_bytes;
#pragma unroll
            for (u32 i = 0; i < 16; ++i) {
                const u32 col = col0 + mt.pair_col(i);
                ptx::st_global_b32(base + 2ull * col,
                                   ptx::cvt_rn_bf16x2_f32(out[4 * i + 2 * half], out[4 * i + 2 * half + 1]));
            }
        }
    }
};

}  // namespace megamoe_rt::gemm
