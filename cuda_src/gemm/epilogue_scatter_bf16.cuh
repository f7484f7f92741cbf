// The bf16 scatter the combine uses: each row of D goes to its own byte address
// row_dst[row], local or a peer's; 0 drops the row.
#pragma once

#include "common/types.cuh"
#include "gemm/epilogue_bf16.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/quad_transpose.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

struct ScatterBf16Epilogue {
    using Params = ScatterBf16Params;

    template <class Cfg>
    static __device__ __forceinline__ void store(const Params& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& /*sm*/, const PromotedSums<Cfg>& out) {
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 r = mt.row0 + 8 * half;
            // Plain load: in the fused kernel these addresses are written earlier in the same launch.
            u8* base = r < tile.rows ? reinterpret_cast<u8*>(p.row_dst[tile.row0 + r]) : nullptr;
            store_bf16_row<Cfg>(base, base != nullptr, out, mt, tile, half);
        }
    }
};

}  // namespace megamoe_rt::gemm
