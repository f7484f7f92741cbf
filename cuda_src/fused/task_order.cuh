// The fused kernel's lag task order, as the device walks it.
//
// A unit is up to kUnitBlocks consecutive BLOCK_M-row blocks of one expert, units in pool
// (expert) order. The order holds the L1 task of every unit in order, and after the L1 task
// of unit j, whole groups of `group` L2 tasks for the units at least `lag` units behind; the
// remaining L2 tasks close the order. A lag at least the unit count gives the single-wave
// order (every L1, then every L2). Each task expands into tiles n-block-major: n-block 0 of
// the unit's blocks, then n-block 1, ... so a wave of CTAs shares each weight tile among
// up to 8 row blocks and a unit streams its expert's weights once (m-block-major would
// stream them once per wave). The CPU model is megamoe_rt/schedule/task_order.py:lag_task_order.
//
// Blocks take order positions in order from a launch-wide ticket (fused/tile_queue.cuh).
// Each dependency of a tile (its rows, its L1 output, a free ring slot) is produced by a tile
// earlier in the order, which is what keeps the persistent grid free of deadlock.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::fused {

constexpr u32 kUnitBlocks = 8;

// The pool blocks of one unit.
struct UnitSpan {
    u32 expert;
    u32 first_block;
    u32 blocks;  // 1 .. kUnitBlocks
};

// Units by expert, in shared memory, sized by the expert count rather than the pool: unit u
// belongs to the expert e with unit_begin[e] <= u < unit_begin[e + 1] and covers up to
// kUnitBlocks of its blocks, from the expert's first block + kUnitBlocks * (u - unit_begin[e]).
// A task order looks a unit up once per task (a binary search over the experts).
struct UnitTable {
    const i32* row_begin;   // [num_experts + 1] first pool row of each expert (block-aligned); last = total
    const u32* unit_begin;  // [num_experts + 1] first unit of each expert; last = num_units
    u32 num_experts;
    u32 num_units;
    u32 block_rows;  // rows of a pool block

    __device__ __forceinline__ UnitSpan span(u32 u) const {
        // The last expert whose first unit is at most u (experts without units share theirs
        // with the next one, which is the one that owns u).
        u32 lo = 0, hi = num_experts;
        while (hi - lo > 1) {
            const u32 mid = (lo + hi) / 2;
            if (unit_begin[mid] <= u) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        const u32 first = static_cast<u32>(row_begin[lo]) / block_rows + (u - unit_begin[lo]) * kUnitBlocks;
        const u32 end = static_cast<u32>(row_begin[lo + 1]) / block_rows;
        return UnitSpan{lo, first, min(kUnitBlocks, end - first)};
    }
};

struct OrderedTile {
    bool l2;      // L2 (down projection) tile, else L1 (gate|up + SwiGLU)
    u32 block;    // pool block, in [0, total blocks)
    u32 expert;   // local expert
    u32 n_block;  // n-block within the GEMM's N
};

// Tile `i` of a task over a unit: n-block-major, so the unit's blocks share each weight tile.
__device__ __forceinline__ void unit_tile(const UnitSpan& unit, u32 i, bool l2, OrderedTile& out) {
    out.l2 = l2;
    out.block = unit.first_block + i % unit.blocks;
    out.expert = unit.expert;
    out.n_block = i / unit.blocks;
}

class LagTaskOrder {
  public:
    __device__ __forceinline__ LagTaskOrder(const UnitTable& units, u32 lag, u32 group, u32 l1_n_blocks,
                                            u32 l2_n_blocks)
        : units_(units),
          lag_(static_cast<i32>(lag)),
          group_(static_cast<i32>(group)),
          n1_(l1_n_blocks),
          n2_(l2_n_blocks) {}

    // Tile `t` of the order; false past its end. Calls must come with non-decreasing t.
    __device__ __forceinline__ bool tile(u32 t, OrderedTile& out) {
        while (t >= begin_ + tiles_) {
            begin_ += tiles_;
            if (!next_task()) return false;
        }
        unit_tile(span_, t - begin_, l2_, out);
        return true;
    }

  private:
    __device__ __forceinline__ bool next_task() {
        if (pending_l2_ > 0) {
            l2_ = true;
            unit_ = next_l2_++;
            --pending_l2_;
        } else if (next_l1_ < units_.num_units) {
            l2_ = false;
            unit_ = next_l1_++;
            // Release whole groups of units that are now `lag` units behind.
            while (static_cast<i32>(next_l1_) - lag_ - static_cast<i32>(next_l2_ + pending_l2_) >= group_)
                pending_l2_ += static_cast<u32>(group_);
        } else if (next_l2_ < units_.num_units) {
            l2_ = true;
            unit_ = next_l2_++;
        } else {
            return false;
        }
        span_ = units_.span(unit_);
        tiles_ = span_.blocks * (l2_ ? n2_ : n1_);
        return true;
    }

    UnitTable units_;
    i32 lag_, group_;
    u32 n1_, n2_;
    u32 next_l1_ = 0, next_l2_ = 0, pending_l2_ = 0;
    bool l2_ = false;
    u32 unit_ = 0;
    UnitSpan span_{};
    u32 begin_ = 0, tiles_ = 0;
};

// One layer's tiles alone, units in pool order, each unit n-block-major as above: what each
// kernel of the split pipeline walks (K1 the L1 tiles, K2 the L2 tiles, concurrently).
// Every dependency inside one such order (a pool slot's earlier block) is again earlier in
// it, and K2's waits on K1 point into K1's order only, so neither kernel can deadlock the other.
class LayerTaskOrder {
  public:
    __device__ __forceinline__ LayerTaskOrder(const UnitTable& units, u32 n_blocks, bool l2)
        : units_(units), n_(n_blocks), l2_(l2) {}

    // Tile `t` of the layer; false past its end. Calls must come with non-decreasing t.
    __device__ __forceinline__ bool tile(u32 t, OrderedTile& out) {
        while (t >= begin_ + tiles_) {
            begin_ += tiles_;
            if (next_unit_ >= units_.num_units) return false;
            span_ = units_.span(next_unit_++);
            tiles_ = span_.blocks * n_;
        }
        unit_tile(span_, t - begin_, l2_, out);
        return true;
    }

  private:
    UnitTable units_;
    u32 n_;
    bool l2_;
    u32 next_unit_ = 0;
    UnitSpan span_{};
    u32 begin_ = 0, tiles_ = 0;
};

}  // namespace megamoe_rt::fused
