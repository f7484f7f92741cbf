// bf16 epilogues: plain row-major store, and the per-row scatter the combine uses
// (each row goes to its own byte address, local or a peer's, 0 drops the row).
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

template <class Cfg>
__device__ __forceinline__ u8* bf16_row_base(const GemmParams& p, const Tile& tile, u32 r) {
    if constexpr (Cfg::kEpilogue == Epilogue::kScatterBf16) {
        // Plain load: in the fused kernel these addresses are written earlier in the same launch.
        return reinterpret_cast<u8*>(p.row_dst[tile.row0 + r]);
    } else {
        return p.d + static_cast<u64>(tile.d_row0 + r) * p.d_row_stride_bytes;
    }
}

template <class Cfg>
__device__ __forceinline__ void epilogue_store_bf16(const GemmParams& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                    const float (&out)[64]) {
    const u32 col0 = mt.col0(tile);
#pragma unroll
    for (u32 half = 0; half < 2; ++half) {
        const u32 r = mt.row0 + 8 * half;
        if (r >= tile.rows) continue;
        u8* base = bf16_row_base<Cfg>(p, tile, r);
        if (base == nullptr) continue;
#pragma unroll
        for (u32 i = 0; i < 16; ++i) {
            const u32 col = col0 + mt.pair_col(i);
            ptx::st_global_b32(base + 2ull * col,
                               ptx::cvt_rn_bf16x2_f32(out[4 * i + 2 * half], out[4 * i + 2 * half + 1]));
        }
    }
}

}  // namespace megamoe_rt::gemm
