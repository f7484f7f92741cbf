// Tiles handed out by a launch-wide ticket, and the hand-over from a block's producer to its
// math warpgroups.
//
// A static round-robin split gives every block the same number of tiles, but L1 and L2 tiles
// differ in cost and the task order mixes them unevenly, so blocks finish hundreds of
// microseconds apart. Instead the producer takes the next order position from a GPU-wide
// counter before each tile. Tickets come in task order, so the earliest unfinished tile is
// always held by a block that is working on it, as with the static split: the deadlock
// argument of task_order.cuh is unchanged. The producer passes each ticket to the math
// warpgroups through a small shared-memory ring on mbarriers, which keeps both walking the
// same positions in the same order. The producer resolves each position to its tile before
// handing it over, so the math warpgroups keep no task order in their registers (which the
// 128 x 256 tile's promoted sums need).
#pragma once

#include "common/types.cuh"
#include "gemm/params.cuh"
#include "gemm/tile_scheduler.cuh"
#include "interface/fused.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/mbarrier.cuh"
#include "sync/mbarrier_deadline.cuh"

namespace megamoe_rt::fused {

// A resolved tile as the queue holds it (16 bytes): end | L2 | rows | n-block, the pool block,
// the expert and the first A/D row (the block's ring slot, or the block itself when streamed).
struct QueuedTile {
    static constexpr u32 kEnd = 1u << 31;
    static constexpr u32 kL2 = 1u << 30;
    static constexpr u32 kRowsShift = 16;  // rows <= kBlockM in bits 16..23
    static constexpr u32 kNBlockMask = (1u << kRowsShift) - 1;
    static_assert(kBlockM < 256, "a tile's rows fit eight bits");

    u32 word, block, expert, a_row0;

    __device__ __forceinline__ bool end() const { return (word & kEnd) != 0; }
    __device__ __forceinline__ bool l2() const { return (word & kL2) != 0; }
    __device__ __forceinline__ gemm::Tile tile() const {
        gemm::Tile t{};
        t.valid = true;
        t.group = expert;
        t.row0 = block * kBlockM;
        t.a_row0 = t.d_row0 = a_row0;
        t.rows = (word >> kRowsShift) & 0xFFu;
        t.n0 = (word & kNBlockMask) * kBlockN;
        return t;
    }
};

struct TileQueue {
    static constexpr u32 kDepth = 4;  // a power of two (TileQueueCursor)
    static constexpr u32 kBytes = kDepth * (8 + 8 + sizeof(QueuedTile));
    static_assert(kBytes == kTileQueueBytes, "the host reserves kTileQueueBytes (interface/fused.cuh) for the queue");

    u64* full;          // [kDepth] one arrival: the producer's tile is in
    u64* empty;         // [kDepth] one arrival per math warp: the tile was read
    QueuedTile* tiles;  // [kDepth], 16-byte aligned (after 16 barriers)

    __device__ __forceinline__ explicit TileQueue(u8* base)
        : full(reinterpret_cast<u64*>(base)),
          empty(full + kDepth),
          tiles(reinterpret_cast<QueuedTile*>(empty + kDepth)) {}

    __device__ __forceinline__ void init(u32 math_warps) const {
        for (u32 i = 0; i < kDepth; ++i) {
            ptx::mbarrier_init_shared(full + i, 1);
            ptx::mbarrier_init_shared(empty + i, math_warps);
        }
    }
};

// Tiles handed over so far: one word, the slot and its phase derived (kDepth is a power of two).
// The math warpgroups also number their relay posts by it (one post per tile).
struct TileQueueCursor {
    u32 count = 0;
    __device__ __forceinline__ u32 slot() const { return count % TileQueue::kDepth; }
    __device__ __forceinline__ u32 phase() const { return (count / TileQueue::kDepth) & 1; }
    __device__ __forceinline__ void advance() { ++count; }
};

// Producer: publish `tile` of layer 1 or 2 of pool block `block` (the first pass finds every
// slot free), or with `end` the marker after the last one.
__device__ __forceinline__ void push_tile(const TileQueue& q, TileQueueCursor& c, const gemm::Tile& tile, bool l2,
                                          u32 block, const sync::MbarrierDeadline& deadline, bool end = false) {
    sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kTileTicket>(q.empty + c.slot(), c.phase() ^ 1, deadline,
                                                                           c.slot());
    const u32 word = (end ? QueuedTile::kEnd : 0u) | (l2 ? QueuedTile::kL2 : 0u) |
                     (tile.rows << QueuedTile::kRowsShift) | (tile.n0 / kBlockN);
    q.tiles[c.slot()] = QueuedTile{word, block, tile.group, tile.a_row0};
    ptx::mbarrier_arrive_shared(q.full + c.slot());
    c.advance();
}

__device__ __forceinline__ void push_end(const TileQueue& q, TileQueueCursor& c,
                                         const sync::MbarrierDeadline& deadline) {
    push_tile(q, c, gemm::Tile{}, false, 0, deadline, true);
}

// Math threads: wait for the next tile and read it in place. The slot stays the math warps'
// until release_tile, so what the epilogue needs (rows, block, addresses) is read again from
// shared memory after the mainloop instead of being held in registers through it (the 128 x 256
// tile's promoted sums leave none to spare). No deadline check of its own (a check here spilled
// with NVRTC 13.0): the producer pushes a tile for every position and the end marker, and each
// of its own waits has a deadline, so a missing tile ends in the producer's trap.
__device__ __forceinline__ const QueuedTile& wait_tile(const TileQueue& q, const TileQueueCursor& c) {
    ptx::mbarrier_wait_parity_shared_bounded_elsewhere(q.full + c.slot(), c.phase());
    return q.tiles[c.slot()];
}

// Lane 0 of each warp frees the slot once its warp is done with the tile.
__device__ __forceinline__ void release_tile(const TileQueue& q, TileQueueCursor& c, u32 lane) {
    __syncwarp();
    ptx::mbarrier_arrive_shared_if(q.empty + c.slot(), lane == 0);
    c.advance();
}

}  // namespace megamoe_rt::fused
