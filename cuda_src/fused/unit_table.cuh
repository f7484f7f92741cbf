// The pool layout and unit table of the fused task stream, from per-expert row counts.
//
// The fused kernel builds these in shared memory once the counts are known, and
// probe/task_stream_order.cu builds them the same way, so that what it checks against the
// CPU model is the table and the walk (fused/task_stream.cuh) the fused kernel runs.
#pragma once

#include "common/types.cuh"
#include "common/warp_scan.cuh"
#include "fused/task_stream.cuh"

namespace megamoe_rt::fused {

__device__ __forceinline__ u32 ceil_div(u32 a, u32 b) { return (a + b - 1) / b; }

// One warp: block-aligned exclusive scan of the counts into rows, units per expert into the
// unit table. Counts and units are packed (blocks | units << 16) into one scan: the host
// keeps the worst-case block count below 2^16.
//   counts      [num_experts] routed rows of each expert (kBlockRows rows to a pool block)
//   row_begin   [num_experts + 1] first pool row of each expert; last = total rows
//   row_end     [num_experts] end of its routed rows
//   unit_first  [max_blocks] first pool block of each unit
//   unit_info   [max_blocks] (expert << 3) | (blocks - 1) of each unit
//   scalars     [0] units, [1] blocks, [2] pool overflow (more blocks than max_blocks)
template <u32 kBlockRows>
__device__ __forceinline__ void build_unit_table(const u32* counts, u32 num_experts, u32 max_blocks, i32* row_begin,
                                                 i32* row_end, u16* unit_first, u16* unit_info, u32* scalars) {
    const u32 lane = threadIdx.x % 32;
    const u32 el = num_experts;
    const u32 per = ceil_div(el, 32);
    const u32 e0 = min(lane * per, el), e1 = min(e0 + per, el);
    u32 local = 0;
    for (u32 e = e0; e < e1; ++e) {
        const u32 blocks = ceil_div(counts[e], kBlockRows);
        local += blocks | (ceil_div(blocks, kUnitBlocks) << 16);
    }
    const u32 incl = warp_inclusive_sum(local);
    u32 running = incl - local;
    for (u32 e = e0; e < e1; ++e) {
        const u32 block0 = running & 0xFFFFu, unit0 = running >> 16;
        const u32 blocks = ceil_div(counts[e], kBlockRows);
        row_begin[e] = static_cast<i32>(block0 * kBlockRows);
        row_end[e] = static_cast<i32>(block0 * kBlockRows + counts[e]);
        // The bound check only matters for a routing past the worst-case pool (flagged below).
        for (u32 u = 0; u * kUnitBlocks < blocks && unit0 + u < max_blocks; ++u) {
            unit_first[unit0 + u] = static_cast<u16>(block0 + u * kUnitBlocks);
            unit_info[unit0 + u] = static_cast<u16>((e << 3) | (min(kUnitBlocks, blocks - u * kUnitBlocks) - 1));
        }
        running += blocks | (ceil_div(blocks, kUnitBlocks) << 16);
    }
    if (lane == 31) {
        const u32 total_blocks = incl & 0xFFFFu;
        row_begin[el] = static_cast<i32>(total_blocks * kBlockRows);
        scalars[0] = incl >> 16;
        scalars[1] = total_blocks;
        scalars[2] = total_blocks > max_blocks;
    }
}

}  // namespace megamoe_rt::fused
