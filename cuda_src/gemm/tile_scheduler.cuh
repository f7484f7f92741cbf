// Persistent tile scheduler over (group, m-block, n-block).
//
// A CTA's producer walks the tile sequence (blockIdx.x, blockIdx.x + gridDim.x, ...),
// skips the empty tiles and announces the others to its math warpgroups
// (gemm/tile_slots.cuh), so only one thread pays for each lookup. Tiles
// are numbered m-block-major: the n-blocks of one m-block run on neighbouring
// CTAs at the same time, so an A block is read from HBM once and then served
// from L2, and a wave covers a few m-blocks against the whole of one group's B.
#pragma once

#include "common/types.cuh"
#include "gemm/params.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::gemm {

struct Tile {
    bool valid;
    u32 group;
    u32 row0;    // first row of the per-row metadata (top-k weight, scatter address)
    u32 a_row0;  // first row of A and its scales
    u32 d_row0;  // first row of D and its scales
    u32 rows;    // valid rows in this tile (<= BLOCK_M)
    u32 n0;      // first output column within the group
    u32 b_row0;  // first row of B viewed as [num_groups * n, k]
};

// With clusters of kClusterN CTAs along N, a "tile" index names one m-block and
// kClusterN neighbouring n-blocks; CTA `rank` of the cluster takes the rank-th.
// Both CTAs of a cluster see the same m-block, so they skip the same tiles.
template <u32 kBlockM, u32 kBlockN, GroupLayout kLayout, u32 kClusterN = 1>
struct TileScheduler {
    const GemmParams& p;
    u32 num_n_groups;  // n-blocks / kClusterN
    u32 num_tiles;

    __device__ __forceinline__ explicit TileScheduler(const GemmParams& params) : p(params) {
        num_n_groups = p.n / (kBlockN * kClusterN);
        const u32 m_blocks = kLayout == GroupLayout::kContiguous
                                 ? (p.num_rows + kBlockM - 1) / kBlockM
                                 : p.num_groups * ((p.masked_rows + kBlockM - 1) / kBlockM);
        num_tiles = m_blocks * num_n_groups;
    }

    __device__ __forceinline__ Tile get(u32 t, u32 rank = 0) const {
        Tile tile{};
        const u32 mb = t / num_n_groups;
        const u32 nb = (t % num_n_groups) * kClusterN + rank;
        tile.n0 = nb * kBlockN;
        if constexpr (kLayout == GroupLayout::kContiguous) {
            // A and D hold the window [row_base, row_base + num_rows) of the group layout's rows
            // (a ring of the pool, one cycle at a time); offsets and metadata are in layout rows.
            const u32 row0 = p.row_base + mb * kBlockM;
            const u32 end = static_cast<u32>(ptx::ld_global_nc_s32(p.group_offsets + p.num_groups));
            if (row0 >= end) return tile;
            // Last group whose start is <= row0 (starts are non-decreasing).
            u32 lo = 0, hi = p.num_groups;
            while (hi - lo > 1) {
                const u32 mid = (lo + hi) / 2;
                if (static_cast<u32>(ptx::ld_global_nc_s32(p.group_offsets + mid)) <= row0)
                    lo = mid;
                else
                    hi = mid;
            }
            const u32 start = static_cast<u32>(ptx::ld_global_nc_s32(p.group_offsets + lo));
            if (row0 < start) return tile;  // rows before the first group belong to none
            u32 limit = static_cast<u32>(ptx::ld_global_nc_s32(p.group_offsets + lo + 1));
            if (p.group_counts != nullptr) {
                const u32 count = static_cast<u32>(ptx::ld_global_nc_s32(p.group_counts + lo));
                limit = min(limit, start + count);
            }
            if (row0 >= limit) return tile;
            tile.group = lo;
            tile.row0 = row0;
            tile.a_row0 = tile.d_row0 = mb * kBlockM;
            tile.rows = min(kBlockM, limit - row0);
            if (p.block_map != nullptr) {
                // The layout's block lives elsewhere in A, D and the metadata (row_base is 0 then).
                static_assert(kBlockMapRows % kBlockM == 0, "a tile never straddles two mapped blocks");
                const u32 block = static_cast<u32>(ptx::ld_global_nc_s32(p.block_map + row0 / kBlockMapRows));
                tile.row0 = tile.a_row0 = tile.d_row0 = block * kBlockMapRows + row0 % kBlockMapRows;
            }
        } else {
            const u32 blocks_per_group = (p.masked_rows + kBlockM - 1) / kBlockM;
            const u32 g = mb / blocks_per_group;
            const u32 local = (mb % blocks_per_group) * kBlockM;
            const u32 count = min(static_cast<u32>(ptx::ld_global_nc_s32(p.masked_counts + g)), p.masked_rows);
            if (local >= count) return tile;
            tile.group = g;
            tile.row0 = g * p.masked_rows + local;
            tile.rows = min(kBlockM, count - local);
            tile.a_row0 = tile.d_row0 = tile.row0;
        }
        tile.b_row0 = tile.group * p.n + tile.n0;
        tile.valid = true;
        return tile;
    }
};

}  // namespace megamoe_rt::gemm
