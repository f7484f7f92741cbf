// A streamed call's pool rows, reserved a pair at a time as chunks arrive, for consumers that
// hand blocks to the GEMMs as they complete (stream/ready_blocks.cuh).
//
// Rows of one expert fill its blocks in reservation order; the row that opens a block takes the
// next block of the call-wide counter and publishes it in the expert's block table, rows after it
// in the same block wait for that entry (the opener has its row already, so it is running and the
// wait is short). The row that fills a block makes the block's size known. The waits trap without
// printf, so wgmma kernels can reserve rows too.
#pragma once

#include "common/types.cuh"
#include "interface/stream.cuh"
#include "interface/sync.cuh"
#include "ptx/ld_st.cuh"
#include "stream/ready_blocks.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::stream {

struct ExpertRowTables {
    u32* expert_counts;  // [num_experts] rows reserved so far
    u32* expert_blocks;  // [num_experts, blocks_per_expert] pool block + 1, 0 until opened
    u32* blocks_claimed;
    u32* block_expert;  // [max_blocks] the expert of each opened block (null: not kept)
    u32 blocks_per_expert;
    u32 block_rows;  // at most 128 (the block word's row count)
};

struct ReservedRow {
    u32 block;  // pool block
    u32 row;    // row within the block
};

// By one thread, for one pair of local expert `expert`. The caller sizes the tables so that no
// expert can need more than blocks_per_expert blocks (each pair is one row).
__device__ __forceinline__ ReservedRow reserve_expert_row(const ExpertRowTables& t, const ReadyBlocks& rb, u32 expert,
                                                          const sync::WaitContext& wait) {
    const u32 n = atomicAdd(t.expert_counts + expert, 1u);
    const u32 row = n % t.block_rows;
    u32* entry = t.expert_blocks + static_cast<u64>(expert) * t.blocks_per_expert + n / t.block_rows;
    u32 block;
    if (row == 0) {
        block = atomicAdd(t.blocks_claimed, 1u);
        // Released with the entry, and again by every addition to the block's word: whoever
        // acquires the block off the ready list reads its expert.
        if (t.block_expert != nullptr) t.block_expert[block] = expert;
        ptx::st_release_gpu_u32(entry, block + 1);
    } else {
        block = sync::wait_ge_acquire_gpu_u32(entry, 1u, sync::WaitSite::kStreamPoolBlockClaimed, wait, expert) - 1;
    }
    if (row + 1 == t.block_rows) block_size_known(rb, block, t.block_rows);
    return ReservedRow{block, row};
}

// The seal's part per expert, once every pair of the call is reserved: the partial block the
// expert ends with gets its size (a full one got it from its last row).
__device__ __forceinline__ void seal_expert_blocks(const ExpertRowTables& t, const ReadyBlocks& rb, u32 expert) {
    const u32 rows = ptx::ld_acquire_gpu_u32(t.expert_counts + expert);
    if (rows % t.block_rows == 0) return;
    const u32 entry =
        ptx::ld_acquire_gpu_u32(t.expert_blocks + static_cast<u64>(expert) * t.blocks_per_expert + rows / t.block_rows);
    block_size_known(rb, entry - 1, rows % t.block_rows);
}

}  // namespace megamoe_rt::stream
