// Test kernel: the fused kernel's task order, dumped tile by tile.
//
// One warp builds the unit table from per-expert block counts with the fused kernel's own
// code (fused/unit_table.cuh, in shared memory as there), then lane 0 walks the order
// (fused/task_order.cuh) from position 0 to its end and writes every tile in order. The
// host compares the order with its CPU model (megamoe_rt/schedule/task_order.py), so the
// model is checked against the code the device runs rather than against a port of it.
//
// Dynamic shared memory, laid out as the fused kernel's tables:
//   row_begin i32[num_experts + 1], row_end i32[num_experts], scalars u32[4],
//   unit_begin u32[num_experts + 1]
// i.e. fused::unit_table_bytes(num_experts) bytes (interface/fused.cuh).
//
// Output:
//   tiles  u32[capacity][4]: per tile, in task order, l2 (0 or 1), block, expert, n_block
//   info   u32[4]: [0] tiles in the order, [1] units, [2] blocks, [3] pool overflow
// The walk stops one tile past `capacity` (and writes only the first `capacity`), so an
// order that does not end still returns: info[0] == capacity + 1 then says it ran over.
// A pool past `max_blocks` walks nothing (info[0] == 0), as the fused kernel runs no tile.

#include "common/types.cuh"
#include "fused/task_order.cuh"
#include "fused/unit_table.cuh"

namespace megamoe_rt::probe {

__global__ void __launch_bounds__(32, 1)
    task_order_walker(const u32* blocks_per_expert, u32 num_experts, u32 max_blocks, u32 lag, u32 group,
                      u32 l1_n_blocks, u32 l2_n_blocks, u32* tiles, u32 capacity, u32* info) {
    extern __shared__ __align__(16) u8 smem[];
    i32* row_begin = reinterpret_cast<i32*>(smem);
    i32* row_end = row_begin + num_experts + 1;
    u32* scalars = reinterpret_cast<u32*>(row_end + num_experts);
    u32* unit_begin = scalars + 4;

    // One row to a block: the counts are block counts, so the table is the fused kernel's for
    // experts of those many (full or partial) blocks.
    fused::build_unit_table<1>(blocks_per_expert, num_experts, max_blocks, row_begin, row_end, unit_begin, scalars);
    __syncthreads();
    if (threadIdx.x != 0) return;

    const bool overflow = scalars[2] != 0;
    u32 n = 0;
    if (!overflow) {
        fused::LagTaskOrder order(fused::UnitTable{row_begin, unit_begin, num_experts, scalars[0], 1}, lag, group,
                                  l1_n_blocks, l2_n_blocks);
        fused::OrderedTile s;
        for (; n <= capacity; ++n) {
            if (!order.tile(n, s)) break;
            if (n == capacity) continue;  // one past the output: counted, not written
            u32* out = tiles + 4ull * n;
            out[0] = s.l2 ? 1u : 0u;
            out[1] = s.block;
            out[2] = s.expert;
            out[3] = s.n_block;
        }
    }
    info[0] = n;
    info[1] = scalars[0];
    info[2] = scalars[1];
    info[3] = scalars[2];
}

}  // namespace megamoe_rt::probe
