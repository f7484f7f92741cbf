// The fused kernel on a streamed call (Role::kStreamed, one rank): the layer consumes the input
// ring chunk by chunk (stream/producer.cuh) and starts L1 on a pool block as soon as the block
// is complete, while later chunks are still being produced.
//
// There is no routing phase and no grid barrier before the tiles:
//   dispatch warps   every block's two, over every chunk in order: wait until both halves of
//                    the chunk are published, reserve a pool row per pair of a local expert
//                    (stream/expert_rows.cuh: an expert's rows fill its blocks, a block at a
//                    time from a call-wide counter), write the row's metadata, copy its x row
//                    and scales in, and count the rows written in their block's word
//                    (stream/ready_blocks.cuh), which appends the block to the ready list once
//                    complete. The chunk's expert ids are kept for the combine. The last warp
//                    through a slot releases it to the producer; the warp that completes the
//                    call's reservations seals it (the partial blocks get their sizes).
//   producer warp    takes tickets in the lag order over ready-list positions
//                    (fused/stream_order.cuh), waits until the ticket's task is fixed and its
//                    block is there (an L2 task also for its L1 tiles), and hands the math
//                    warpgroups the resolved tile as one word (StreamTileWord).
//   math warpgroups  read the block's expert and size from global memory (written before the
//                    block's completion was released) and run the tile as in the batch call.
//
// Progress (docs/STREAMING.md, "Streaming into the fused kernel"): dispatch waits only for the
// producer, which runs on SMs this launch leaves free (the host's grid); tickets wait only for
// dispatch and for smaller tickets. The pool is the full worst-case pool: no slot is reused.
#pragma once

#include "common/types.cuh"
#include "fused/params.cuh"
#include "fused/stream_order.cuh"
#include "fused/trace.cuh"
#include "gemm/tile_scheduler.cuh"
#include "interface/stream.cuh"
#include "moe/params.cuh"
#include "moe/pool_row.cuh"
#include "ptx/ld_st.cuh"
#include "stream/expert_rows.cuh"
#include "stream/producer.cuh"
#include "stream/ready_blocks.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::fused {

// A resolved tile, from the producer warp to the math warpgroups in one 32-bit queue slot:
// end | L2 | pool block (24 bits) | n-block (6 bits). The host keeps both layers' n-blocks
// within 64 for a streamed call (kernels/fused.py, STREAMED_MAX_N_BLOCKS).
struct StreamTileWord {
    static constexpr u32 kEnd = 1u << 31;
    static constexpr u32 kL2 = 1u << 30;
    static constexpr u32 kBlockShift = 6;
    static constexpr u32 kNBlockMask = (1u << kBlockShift) - 1;
    static constexpr u32 kBlockMask = (1u << 24) - 1;

    static __device__ __forceinline__ u32 encode(bool l2, u32 block, u32 n_block) {
        return (l2 ? kL2 : 0u) | (block << kBlockShift) | n_block;
    }
    static __device__ __forceinline__ u32 block(u32 word) { return (word >> kBlockShift) & kBlockMask; }
    static __device__ __forceinline__ u32 n_block(u32 word) { return word & kNBlockMask; }
};
static_assert(kMaxBlocks - 1 <= StreamTileWord::kBlockMask, "a pool block fits the tile word");

// The GEMM tile of `n_block` of a complete block. Strong (L2) loads: this SM's L1 may hold the
// line from before the block was opened.
__device__ __forceinline__ gemm::Tile streamed_tile(const FusedParams& p, u32 block, u32 n_block) {
    gemm::Tile tile{};
    tile.valid = true;
    tile.group = ptx::ld_relaxed_gpu_u32(p.streamed.block_expert + block);
    tile.row0 = block * kBlockM;
    tile.a_row0 = tile.d_row0 = tile.row0;
    tile.rows = ptx::ld_relaxed_gpu_u32(p.streamed.ready.state + block) >> stream::kSizeShift;
    tile.n0 = n_block * kBlockN;
    return tile;
}

__device__ __forceinline__ stream::ExpertRowTables streamed_row_tables(const stream::StreamedPool& s) {
    return stream::ExpertRowTables{s.expert_counts, s.expert_blocks,     s.blocks_claimed,
                                   s.block_expert,  s.blocks_per_expert, kBlockM};
}

// One warp, once every pair of the call has its row: the partial blocks' sizes, the statistics,
// then the number of ready-list positions.
__device__ __forceinline__ void seal_streamed_call(const FusedParams& p, u32 lane) {
    const stream::StreamedPool& s = p.streamed;
    const stream::ExpertRowTables tables = streamed_row_tables(s);
    for (u32 e = lane; e < p.moe.num_local_experts; e += 32) {
        stream::seal_expert_blocks(tables, s.ready, e);
        if (p.moe.expert_recv_stats != nullptr)
            p.moe.expert_recv_stats[e] += static_cast<i32>(ptx::ld_relaxed_gpu_u32(s.expert_counts + e));
    }
    __syncwarp();
    if (lane == 0) stream::seal_ready_list(s.ready, ptx::ld_acquire_gpu_u32(s.blocks_claimed));
}

// Dispatch warp `warp` of `num_warps`. Pairs are dealt out a lane at a time across every warp,
// so a chunk smaller than the launch still keeps every warp copying; a warp's lanes reserve
// their rows together, then the warp copies its lanes' rows one by one.
template <u32 kCopyBatch>
__device__ __forceinline__ void dispatch_streamed_chunks(const FusedParams& p, u32 warp, u32 num_warps) {
    constexpr u32 kNoRow = 0xFFFFFFFFu;
    const stream::StreamedPool& s = p.streamed;
    const stream::StreamRing& ring = s.ring;
    const stream::ExpertRowTables tables = streamed_row_tables(s);
    const u32 lane = threadIdx.x % 32;
    const u32 k = p.moe.num_topk;
    const u32 epoch = ptx::ld_acquire_gpu_u32(ring.consumer_epoch);  // counted by stream_begin_consume
    if (s.num_chunks == 0) {  // a call of no tokens (the host launches none) is sealed at the start
        if (warp == 0) seal_streamed_call(p, lane);
        return;
    }
    for (u32 c = 0; c < s.num_chunks; ++c) {
        const u32 first = c * ring.tokens_per_slot;
        const u32 slot = stream::slot_of(ring, c);
        const u64 gen = stream::generation(epoch, c);
        if (lane == 0) {
            sync::wait_ge_acquire_sys_u64_quiet(ring.route_ready_gen + slot, gen, sync::WaitSite::kStreamRouteReady,
                                                p.wait, slot);
            sync::wait_ge_acquire_sys_u64_quiet(ring.layout_ready_gen + slot, gen, sync::WaitSite::kStreamLayoutReady,
                                                p.wait, slot);
            if (warp % 2 == 0 && c + 1 == s.num_chunks) trace(p, kTraceLastChunk);  // the block's first warp
        }
        __syncwarp();
        moe::MoeParams m = p.moe;  // the chunk as a call of its own, its inputs in the slot
        m.x = stream::chunk_x(ring, c);
        m.x_sf = stream::chunk_x_sf(ring, c);
        m.topk_idx = stream::chunk_topk_idx(ring, c);
        m.topk_weights = stream::chunk_topk_weights(ring, c);
        m.token_base = first;
        const u32 pairs = min(ring.tokens_per_slot, p.moe.num_tokens - first) * k;
        for (u32 base = 0; base < pairs; base += num_warps * 32) {
            const u32 pair = base + lane * num_warps + warp;
            u32 row = kNoRow;
            if (pair < pairs) {
                const u32 call_pair = first * k + pair;
                s.call_topk_idx[call_pair] = static_cast<i32>(moe::load_expert_id<i32>(m, pair));
                const i32 e = moe::local_expert<i32>(m, pair);
                // A lane may wait here for a block another lane opens: the opener took its row
                // first and does not wait (diverged lanes progress independently, sm_70+).
                if (e >= 0) {
                    const stream::ReservedRow r =
                        stream::reserve_expert_row(tables, s.ready, static_cast<u32>(e), p.wait);
                    row = r.block * kBlockM + r.row;
                    const u32 token = first + pair / k;
                    m.pool_src[row] = static_cast<i32>(call_pair);
                    m.pool_weight[row] = m.topk_weights[pair];
                    m.pool_dst[row] = reinterpret_cast<u64>(m.combine) +
                                      (static_cast<u64>(pair % k) * m.token_capacity + token) * m.hidden * 2ull;
                }
            }
            for (u32 todo = __ballot_sync(0xFFFFFFFFu, row != kNoRow); todo != 0; todo &= todo - 1) {
                const u32 j = __ffs(todo) - 1;
                const u32 r = __shfl_sync(0xFFFFFFFFu, row, j);
                // The slot is rewritten during the launch: read through L2.
                moe::copy_token_row<true, kCopyBatch>(m, (base + j * num_warps + warp) / k, r, lane);
            }
            // The rows are read by TMA (the async proxy) in other blocks.
            ptx::fence_proxy_async_global();
            __syncwarp();
            if (row != kNoRow) stream::block_rows_written(s.ready, row / kBlockM, 1);
        }
        __syncwarp();  // every lane's reads of the slot are done
        bool seal = false;
        if (lane == 0) {
            // The slot's n-th use in this call is done once every dispatch warp has counted it n
            // times: the next chunk in the slot is published only after this one is released.
            const u32 target = num_warps * (c / ring.num_slots + 1);
            if (ptx::atom_add_acq_rel_gpu_u32(s.slot_done + slot, 1u) + 1 == target) {
                ptx::fence_acq_rel_sys();
                ptx::st_release_sys_u64(ring.consumed_gen + slot, gen);
            }
            seal = ptx::atom_add_acq_rel_gpu_u32(s.parts_done, 1u) + 1 == s.num_chunks * num_warps;
        }
        if (__shfl_sync(0xFFFFFFFFu, seal, 0)) seal_streamed_call(p, lane);
    }
}

}  // namespace megamoe_rt::fused
