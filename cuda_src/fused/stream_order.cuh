// The task order of a streamed call in the fused kernel: a lag order over ready-list positions
// (blocks in the order they complete, stream/ready_blocks.cuh) instead of pool units.
//
// Position j's L1 task (l1_tiles tiles), then L2 of position j - lag (l2_tiles tiles); before
// the seal the number of positions is unknown and the order is open-ended, after it the order
// closes with the L2 tasks of the last min(lag, positions) positions. The two agree on every
// ticket up to the period of the last position, so a ticket read off the open order keeps its
// task unless it lies past that period (the waits of docs/STREAMING.md, "Streaming into the
// fused kernel", decide when that is known). Closed form, O(1) per ticket, so a producer warp
// can re-read its ticket at the seal. The CPU model is
// megamoe_rt/schedule/stream_fused.py:ticket_task.
#pragma once

#include "common/types.cuh"
#include "interface/stream.cuh"
#include "interface/sync.cuh"
#include "stream/ready_blocks.cuh"

namespace megamoe_rt::fused {

struct StreamTask {
    bool l2;       // L2 (down projection), else L1 (gate|up + SwiGLU)
    u32 position;  // ready-list position
    u32 tile;      // tile within the task, [0, l1_tiles) or [0, l2_tiles)
};

struct StreamOrder {
    u32 lag;
    u32 l1_tiles;
    u32 l2_tiles;

    // Before the seal: every ticket has a task.
    __device__ __forceinline__ StreamTask open_task(u32 ticket) const {
        if (ticket < lag * l1_tiles) return StreamTask{false, ticket / l1_tiles, ticket % l1_tiles};
        return period_task(ticket - lag * l1_tiles);
    }

    // After the seal, over `positions` positions; false past the order's end.
    __device__ __forceinline__ bool sealed_task(u32 ticket, u32 positions, StreamTask& out) const {
        if (positions <= lag) {  // no period: every L1, then every L2
            if (ticket < positions * l1_tiles) {
                out = StreamTask{false, ticket / l1_tiles, ticket % l1_tiles};
                return true;
            }
            const u32 i = (ticket - positions * l1_tiles) / l2_tiles;
            out = StreamTask{true, i, (ticket - positions * l1_tiles) % l2_tiles};
            return i < positions;
        }
        const u32 periods_end = lag * l1_tiles + (positions - lag) * (l1_tiles + l2_tiles);
        if (ticket < periods_end) {
            out = open_task(ticket);
            return true;
        }
        const u32 i = (ticket - periods_end) / l2_tiles;
        out = StreamTask{true, positions - lag + i, (ticket - periods_end) % l2_tiles};
        return i < lag;
    }

    // Whether an L2 task read off the open order keeps its ticket in the sealed order: once
    // the position whose L1 it follows (position + lag) exists. L1 tasks always do.
    __device__ __forceinline__ u32 position_that_fixes(const StreamTask& task) const {
        return task.l2 ? task.position + lag : task.position;
    }

  private:
    __device__ __forceinline__ StreamTask period_task(u32 u) const {
        const u32 period = l1_tiles + l2_tiles;
        const u32 j = lag + u / period, r = u % period;
        if (r < l1_tiles) return StreamTask{false, j, r};
        return StreamTask{true, j - lag, r - l1_tiles};
    }
};

// The task of `ticket` once it is fixed; false past the sealed order's end. Before the seal a
// ticket's task is fixed once the position it hangs on exists; if the seal says that position
// never will, the ticket belongs to the sealed order's tail (or lies past its end): it is read
// again there. `deadline_shift`: the ready list waits on the consumer's dispatch, whose own
// waits on the producer should report first.
__device__ __forceinline__ bool fixed_stream_task(const stream::ReadyBlocks& rb, const StreamOrder& order, u32 ticket,
                                                  const sync::WaitContext& wait, u32 deadline_shift, StreamTask& task) {
    for (;;) {
        const u32 sealed = stream::sealed_word(rb);
        if (sealed != 0) return order.sealed_task(ticket, sealed - 1, task);
        task = order.open_task(ticket);
        if (stream::wait_ready_position(rb, order.position_that_fixes(task), wait, deadline_shift) !=
            stream::kNoPosition)
            return true;
    }
}

}  // namespace megamoe_rt::fused
