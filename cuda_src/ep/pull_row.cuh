// Pulling one routed row from its source rank over NVLink: the send-list entry, the token's
// e4m3 row and its scales, and the metadata the GEMM epilogues read (top-k weight, the
// address of the row's slot in the source's combine buffer). Shared by the unfused dispatch
// kernel and the fused kernel's dispatch warps.
#pragma once

#include "common/types.cuh"
#include "moe/params.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::ep {

// Where a source rank's regions are, as this rank maps them.
struct SourceRegions {
    u64 base;           // the source rank's buffer
    u64 off_x;          // [T, H] e4m3
    u64 off_x_sf;       // [T, H / 128] float
    u64 off_send_list;  // [T * K] (weight bits << 32) | (token * K + slot)
    u64 off_combine;    // [K, T, H] bf16
};

// 16-byte vectors per lane in flight while a row is pulled: 7 keeps the fused kernel's
// dispatch warps within their register budget (8 spills), and H = 7168 rows take two batches.
constexpr u32 kPullBatch = 7;

// Warp-wide: entry `list_pos` of `source`'s send list into pool row `row` (metadata), whose
// data lands in pool slot row `data_row` (the same row without a ring).
__device__ __forceinline__ void pull_row(const moe::MoeParams& m, const SourceRegions& src_rank, u32 source,
                                         u32 list_pos, u32 row, u32 data_row, u32 lane) {
    const u64 entry = reinterpret_cast<const u64*>(src_rank.base + src_rank.off_send_list)[list_pos];
    const u32 pair = static_cast<u32>(entry);
    const u32 token = pair / m.num_topk, slot = pair % m.num_topk;
    const ptx::u32x4* src =
        reinterpret_cast<const ptx::u32x4*>(src_rank.base + src_rank.off_x + static_cast<u64>(token) * m.hidden);
    ptx::u32x4* dst = reinterpret_cast<ptx::u32x4*>(m.pool + static_cast<u64>(data_row) * m.hidden);
    const u32 sf_cols = m.hidden / 128;
    const float* src_sf =
        reinterpret_cast<const float*>(src_rank.base + src_rank.off_x_sf) + static_cast<u64>(token) * sf_cols;
    // A remote load costs an NVLink round trip: issue the row's first scales and a batch of
    // its vectors before storing any of them, so one row takes about two round trips (the
    // send-list entry, then the data) rather than one per unrolled group.
    const float sf_first = lane < sf_cols ? src_sf[lane] : 0.0f;
    const u32 vecs = m.hidden / 16;
    for (u32 base = 0; base < vecs; base += 32 * kPullBatch) {
        ptx::u32x4 v[kPullBatch];
#pragma unroll
        for (u32 i = 0; i < kPullBatch; ++i)
            if (base + i * 32 + lane < vecs) v[i] = src[base + i * 32 + lane];
#pragma unroll
        for (u32 i = 0; i < kPullBatch; ++i)
            if (base + i * 32 + lane < vecs) dst[base + i * 32 + lane] = v[i];
    }
    if (lane < sf_cols) m.pool_sf[static_cast<u64>(lane) * m.pool_rows + data_row] = sf_first;
    for (u32 c = lane + 32; c < sf_cols; c += 32) m.pool_sf[static_cast<u64>(c) * m.pool_rows + data_row] = src_sf[c];
    if (lane == 0) {
        m.pool_src[row] = static_cast<i32>((source * m.token_capacity + token) * m.num_topk + slot);
        m.pool_weight[row] = __uint_as_float(static_cast<u32>(entry >> 32));
        m.pool_dst[row] = src_rank.base + src_rank.off_combine +
                          (static_cast<u64>(slot) * m.token_capacity + token) * m.hidden * 2ull;
    }
}

}  // namespace megamoe_rt::ep
