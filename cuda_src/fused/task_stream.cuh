// The fused kernel's lag-ordered task stream, as the device walks it.
//
// A unit is up to kUnitBlocks consecutive BLOCK_M-row blocks of one expert, units in pool
// (expert) order. The stream holds the L1 task of every unit in order, and after the L1 task
// of unit j, whole groups of `group` L2 tasks for the units at least `lag` units behind; the
// remaining L2 tasks close the stream. A lag at least the unit count gives the single-wave
// order (every L1, then every L2). Each task expands into tiles n-block-major: n-block 0 of
// the unit's blocks, then n-block 1, ... so a wave of CTAs shares each weight tile among
// up to 8 row blocks and a unit streams its expert's weights once (m-block-major would
// stream them once per wave). The CPU model is megamoe_rt/schedule/task_stream.py:lag_ordered_stream.
//
// Blocks take stream positions in order from a launch-wide ticket (fused/tile_queue.cuh).
// Each dependency of a tile (its rows, its L1 output, a free ring slot) is produced by a tile
// earlier in the stream, which is what keeps the persistent grid free of deadlock.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::fused {

constexpr u32 kUnitBlocks = 8;

// Unit u: first pool block, and (expert << 3) | (blocks - 1). Built in shared memory.
struct UnitTable {
    const u16* first_block;
    const u16* info;
    u32 num_units;

    __device__ __forceinline__ u32 expert(u32 u) const { return info[u] >> 3; }
    __device__ __forceinline__ u32 blocks(u32 u) const { return (info[u] & 7u) + 1; }
};

struct StreamTile {
    bool l2;      // L2 (down projection) tile, else L1 (gate|up + SwiGLU)
    u32 block;    // pool block, in [0, total blocks)
    u32 expert;   // local expert
    u32 n_block;  // n-block within the GEMM's N
};

// Tile `i` of a task over `unit`: n-block-major, so the unit's blocks share each weight tile.
__device__ __forceinline__ void unit_tile(const UnitTable& units, u32 unit, u32 i, bool l2, StreamTile& out) {
    const u32 blocks = units.blocks(unit);
    out.l2 = l2;
    out.block = units.first_block[unit] + i % blocks;
    out.expert = units.expert(unit);
    out.n_block = i / blocks;
}

class LagOrderedStream {
  public:
    __device__ __forceinline__ LagOrderedStream(const UnitTable& units, u32 lag, u32 group, u32 l1_n_blocks,
                                                u32 l2_n_blocks)
        : units_(units),
          lag_(static_cast<i32>(lag)),
          group_(static_cast<i32>(group)),
          n1_(l1_n_blocks),
          n2_(l2_n_blocks) {}

    // Tile `t` of the stream; false past its end. Calls must come with non-decreasing t.
    __device__ __forceinline__ bool tile(u32 t, StreamTile& out) {
        while (t >= begin_ + tiles_) {
            begin_ += tiles_;
            if (!next_task()) return false;
        }
        unit_tile(units_, unit_, t - begin_, l2_, out);
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
        tiles_ = units_.blocks(unit_) * (l2_ ? n2_ : n1_);
        return true;
    }

    UnitTable units_;
    i32 lag_, group_;
    u32 n1_, n2_;
    u32 next_l1_ = 0, next_l2_ = 0, pending_l2_ = 0;
    bool l2_ = false;
    u32 unit_ = 0;
    u32 begin_ = 0, tiles_ = 0;
};

// One layer's tiles alone, units in pool order, each unit n-block-major as above: what each
// kernel of the split pipeline walks (K1 the L1 tiles, K2 the L2 tiles, concurrently).
// Every dependency inside one such stream (a pool slot's earlier block) is again earlier in
// it, and K2's waits on K1 point into K1's stream only, so neither kernel can deadlock the other.
class LayerStream {
  public:
    __device__ __forceinline__ LayerStream(const UnitTable& units, u32 n_blocks, bool l2)
        : units_(units), n_(n_blocks), l2_(l2) {}

    // Tile `t` of the layer; false past its end. Calls must come with non-decreasing t.
    __device__ __forceinline__ bool tile(u32 t, StreamTile& out) {
        while (t >= begin_ + tiles_) {
            begin_ += tiles_;
            if (next_unit_ >= units_.num_units) return false;
            unit_ = next_unit_++;
            tiles_ = units_.blocks(unit_) * n_;
        }
        unit_tile(units_, unit_, t - begin_, l2_, out);
        return true;
    }

  private:
    UnitTable units_;
    u32 n_;
    bool l2_;
    u32 next_unit_ = 0, unit_ = 0;
    u32 begin_ = 0, tiles_ = 0;
};

}  // namespace megamoe_rt::fused
