// Copying one token's input row into the expert pool, shared by the batch dispatch and a
// streamed call's chunk dispatch.
#pragma once

#include "common/types.cuh"
#include "moe/params.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::moe {

// Warp-wide: token `token`'s e4m3 row and scales into data row `data_row` of the pool.
// kRewritten: the inputs may be rewritten during this launch (a streamed call's ring slots,
// refilled while one launch walks every chunk), so they are read through L2 instead of the
// read-only path. Each lane issues kCopyBatch loads before their stores: the stores may alias
// the loads as far as the compiler knows, so a plain loop waits out one load's latency per
// 16 bytes, and a warp's row would take a chain of round trips to L2.
constexpr u32 kCopyBatch = 8;

template <bool kRewritten = false, u32 kBatch = kCopyBatch>
__device__ __forceinline__ void copy_token_row(const MoeParams& p, u32 token, u32 data_row, u32 lane) {
    const u32 sf_cols = p.hidden / 128;
    const u32 vecs = p.hidden / 16;
    const ptx::u32x4* src = reinterpret_cast<const ptx::u32x4*>(p.x + static_cast<u64>(token) * p.hidden);
    ptx::u32x4* dst = reinterpret_cast<ptx::u32x4*>(p.pool + static_cast<u64>(data_row) * p.hidden);
    for (u32 v0 = lane; v0 < vecs; v0 += 32 * kBatch) {
        ptx::u32x4 part[kBatch];
#pragma unroll
        for (u32 i = 0; i < kBatch; ++i) {
            const u32 v = v0 + i * 32;
            if (v < vecs) part[i] = kRewritten ? ptx::ld_global_cg_v4_u32(src + v) : ptx::ld_global_nc_v4_u32(src + v);
        }
#pragma unroll
        for (u32 i = 0; i < kBatch; ++i)
            if (v0 + i * 32 < vecs) dst[v0 + i * 32] = part[i];
    }
    for (u32 j = lane; j < sf_cols; j += 32) {
        const float* sf = p.x_sf + static_cast<u64>(token) * sf_cols + j;
        p.pool_sf[static_cast<u64>(j) * p.pool_rows + data_row] = kRewritten ? ptx::ld_global_cg_f32(sf) : *sf;
    }
}

}  // namespace megamoe_rt::moe
