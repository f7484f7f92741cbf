// The pool layout and unit table of the fused task order, from per-expert row counts.
//
// The fused kernel builds these in shared memory once the counts are known, and
// probe/task_order_walker.cu builds them the same way, so that what it checks against the
// CPU model is the table and the walk (fused/task_order.cuh) the fused kernel runs. Both
// are sized by the expert count: a call's pool can grow without growing shared memory.
#pragma once

#include "common/types.cuh"
#include "common/warp_scan.cuh"
#include "fused/task_order.cuh"

namespace megamoe_rt::fused {

__device__ __forceinline__ u32 ceil_div(u32 a, u32 b) { return (a + b - 1) / b; }

// One warp: block-aligned exclusive scan of the counts into rows, and of the units per expert.
//   counts      [num_experts] routed rows of each expert (kBlockRows rows to a pool block)
//   row_begin   [num_experts + 1] first pool row of each expert; last = total rows
//   row_end     [num_experts] end of its routed rows
//   unit_begin  [num_experts + 1] first unit of each expert; last = total units
//   scalars     [0] units, [1] blocks, [2] pool overflow (more blocks than max_blocks)
template <u32 kBlockRows>
__device__ __forceinline__ void build_unit_table(const u32* counts, u32 num_experts, u32 max_blocks, i32* row_begin,
                                                 i32* row_end, u32* unit_begin, u32* scalars) {
    const u32 lane = threadIdx.x % 32;
    const u32 el = num_experts;
    const u32 per = ceil_div(el, 32);
    const u32 e0 = min(lane * per, el), e1 = min(e0 + per, el);
    u32 blocks_local = 0, units_local = 0;
    for (u32 e = e0; e < e1; ++e) {
        const u32 blocks = ceil_div(counts[e], kBlockRows);
        blocks_local += blocks;
        units_local += ceil_div(blocks, kUnitBlocks);
    }
    const u32 blocks_incl = warp_inclusive_sum(blocks_local);
    const u32 units_incl = warp_inclusive_sum(units_local);
    u32 block = blocks_incl - blocks_local, unit = units_incl - units_local;
    for (u32 e = e0; e < e1; ++e) {
        row_begin[e] = static_cast<i32>(block * kBlockRows);
        row_end[e] = static_cast<i32>(block * kBlockRows + counts[e]);
        unit_begin[e] = unit;
        const u32 blocks = ceil_div(counts[e], kBlockRows);
        block += blocks;
        unit += ceil_div(blocks, kUnitBlocks);
    }
    if (lane == 31) {
        row_begin[el] = static_cast<i32>(blocks_incl * kBlockRows);
        unit_begin[el] = units_incl;
        scalars[0] = units_incl;
        scalars[1] = blocks_incl;
        scalars[2] = blocks_incl > max_blocks;
    }
}

}  // namespace megamoe_rt::fused
