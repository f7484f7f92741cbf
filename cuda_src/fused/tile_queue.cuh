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
// same positions in the same order.
#pragma once

#include "common/types.cuh"
#include "interface/fused.cuh"
#include "ptx/mbarrier.cuh"
#include "sync/mbarrier_deadline.cuh"

namespace megamoe_rt::fused {

struct TileQueue {
    static constexpr u32 kDepth = 4;
    static constexpr u32 kBytes = kDepth * (8 + 8 + 4);
    static_assert(kBytes == kTileQueueBytes, "the host reserves kTileQueueBytes (interface/fused.cuh) for the queue");

    u64* full;     // [kDepth] one arrival: the producer's ticket is in
    u64* empty;    // [kDepth] one arrival per math warp: the ticket was read
    u32* tickets;  // [kDepth]

    __device__ __forceinline__ explicit TileQueue(u8* base)
        : full(reinterpret_cast<u64*>(base)), empty(full + kDepth), tickets(reinterpret_cast<u32*>(empty + kDepth)) {}

    __device__ __forceinline__ void init(u32 math_warps) const {
        for (u32 i = 0; i < kDepth; ++i) {
            ptx::mbarrier_init_shared(full + i, 1);
            ptx::mbarrier_init_shared(empty + i, math_warps);
        }
    }
};

struct TileQueueCursor {
    u32 slot = 0;
    u32 phase = 0;
    __device__ __forceinline__ void advance() {
        if (++slot == TileQueue::kDepth) {
            slot = 0;
            phase ^= 1;
        }
    }
};

// Producer: publish `ticket` (the first pass finds every slot free).
__device__ __forceinline__ void push_ticket(const TileQueue& q, TileQueueCursor& c, u32 ticket,
                                            const sync::MbarrierDeadline& deadline) {
    sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kTileTicket>(q.empty + c.slot, c.phase ^ 1, deadline,
                                                                           c.slot);
    q.tickets[c.slot] = ticket;
    ptx::mbarrier_arrive_shared(q.full + c.slot);
    c.advance();
}

// Math threads: the next ticket; lane 0 of each warp frees the slot once its warp has read it.
// No deadline check of its own (the math warpgroups' registers are spoken for, and a check
// here spilled with NVRTC 13.0): the producer pushes a ticket for every position, the last
// one past the end included, and each of its own waits has a deadline, so a missing ticket
// ends in the producer's trap.
__device__ __forceinline__ u32 pop_ticket(const TileQueue& q, TileQueueCursor& c, u32 lane) {
    ptx::mbarrier_wait_parity_shared_bounded_elsewhere(q.full + c.slot, c.phase);
    const u32 ticket = q.tickets[c.slot];
    __syncwarp();
    ptx::mbarrier_arrive_shared_if(q.empty + c.slot, lane == 0);
    c.advance();
    return ticket;
}

}  // namespace megamoe_rt::fused
