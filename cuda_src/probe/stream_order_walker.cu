// Test kernel: a streamed call's row reservations, ready list, seal and ticket order as the
// fused kernel's streamed consumer is to run them (stream/expert_rows.cuh,
// stream/ready_blocks.cuh, fused/stream_order.cuh), without the GEMMs or any data.
//
// Every block is one SM's worth of the consumer, as a persistent block of the fused kernel:
//   warp 1    dispatch: chunk c counts as published publish_ns[c] after the block starts (the
//             producer, emulated by the clock); the warp reserves a row for each of its share
//             of the chunk's pairs, records the pair in the row and counts the row written; once
//             through a chunk it says so, and the warp that completes the last chunk seals.
//   warp 0    lane 0 takes tickets: reads its task off the open order (or the sealed one), waits
//             until the task is fixed, then for an L1 task until its block is complete, for an
//             L2 task until every L1 tile of its position is done, and logs the task.
// Dispatch never waits on a ticket, and a ticket waits only on dispatch and on smaller tickets,
// so every wait ends while the grid is resident (the host launches at most one block per SM).
//
// The host checks the log against the sealed order (megamoe_rt/schedule/stream_fused.py:
// ticket_task), every pair's row, and the ready list (tests/gpu/test_stream_order_gpu.py).

#include "common/types.cuh"
#include "fused/stream_order.cuh"
#include "interface/probe.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/special_regs.cuh"
#include "stream/expert_rows.cuh"
#include "stream/ready_blocks.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::probe {

__device__ __forceinline__ stream::ExpertRowTables row_tables(const StreamOrderProbeParams& p) {
    return stream::ExpertRowTables{p.expert_counts, p.expert_blocks,     p.blocks_claimed,
                                   nullptr,         p.blocks_per_expert, p.block_rows};
}

// Lane 0 of the dispatch warp that completes a call's reservations.
__device__ __forceinline__ void seal_call(const StreamOrderProbeParams& p) {
    const stream::ExpertRowTables tables = row_tables(p);
    for (u32 e = 0; e < p.num_experts; ++e) stream::seal_expert_blocks(tables, p.ready, e);
    stream::seal_ready_list(p.ready, ptx::ld_acquire_gpu_u32(p.blocks_claimed));
}

__device__ __forceinline__ void dispatch_chunks(const StreamOrderProbeParams& p, u64 start_ns) {
    const u32 lane = threadIdx.x % 32, warp = blockIdx.x, num_warps = gridDim.x;
    const stream::ExpertRowTables tables = row_tables(p);
    if (p.num_chunks == 0) {  // a call of no tokens is sealed at the start
        if (warp == 0 && lane == 0) seal_call(p);
        return;
    }
    for (u32 c = 0; c < p.num_chunks; ++c) {
        const u64 published = start_ns + p.publish_ns[c];
        while (ptx::globaltimer_ns() < published) __nanosleep(256);
        if (lane == 0) atomicMax(reinterpret_cast<unsigned long long*>(p.times_ns + 1), published);
        const u32 end = min(p.num_pairs, (c + 1) * p.pairs_per_chunk);
        for (u32 i = c * p.pairs_per_chunk + warp * 32 + lane; i < end; i += num_warps * 32) {
            const i32 expert = p.expert_of_pair[i];
            if (expert < 0) continue;
            const stream::ReservedRow r = stream::reserve_expert_row(tables, p.ready, static_cast<u32>(expert), p.wait);
            p.pool_pair[static_cast<u64>(r.block) * p.block_rows + r.row] = static_cast<i32>(i);
            stream::block_rows_written(p.ready, r.block, 1);
        }
        __syncwarp();
        if (lane == 0 && ptx::atom_add_acq_rel_gpu_u32(p.parts_reserved, 1u) + 1 == p.num_chunks * num_warps)
            seal_call(p);
    }
}

__device__ __forceinline__ void take_tickets(const StreamOrderProbeParams& p) {
    const fused::StreamOrder order{p.lag, p.l1_tiles, p.l2_tiles};
    for (;;) {
        const u32 ticket = atomicAdd(p.ticket, 1u);
        fused::StreamTask task;
        if (!fused::fixed_stream_task(p.ready, order, ticket, p.wait, 0, task)) return;
        const u32 block = stream::wait_ready_position(p.ready, task.position, p.wait);
        if (!task.l2) {
            atomicMin(reinterpret_cast<unsigned long long*>(p.times_ns), ptx::globaltimer_ns());
            if (!stream::block_complete(ptx::ld_acquire_gpu_u32(p.ready.state + block))) atomicAdd(p.checks, 1u);
            if (ptx::atom_add_acq_rel_gpu_u32(p.l1_done + task.position, 1u) >= p.l1_tiles)
                atomicAdd(p.checks + 1, 1u);  // an L1 tile of the position ran twice
        } else {
            sync::wait_ge_acquire_gpu_u32(p.l1_done + task.position, p.l1_tiles, sync::WaitSite::kL1OutputPublished,
                                          p.wait, task.position, sync::kDerivedWaitShift);
        }
        if (ticket >= p.capacity) {
            atomicAdd(p.checks + 2, 1u);
            continue;
        }
        u32* out = p.task_log + 4ull * ticket;
        out[0] = task.l2 ? 1u : 0u;
        out[1] = task.position;
        out[2] = task.tile;
        out[3] = block;
    }
}

__global__ void __launch_bounds__(64, 1) stream_order_walker(const __grid_constant__ StreamOrderProbeParams p) {
    const u64 start_ns = ptx::globaltimer_ns();
    if (threadIdx.x >= 32) {
        dispatch_chunks(p, start_ns);
    } else if (threadIdx.x == 0) {
        take_tickets(p);
    }
}

}  // namespace megamoe_rt::probe
