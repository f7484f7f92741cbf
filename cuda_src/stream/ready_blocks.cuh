// Pool blocks of a streamed call handed to the GEMMs in the order they complete.
//
// A streamed call learns its routing a chunk at a time, so a pool block (up to `block_rows`
// rows of one expert) is complete when its rows are written and its size is known: the full
// size as soon as its last row is reserved, a partial block's size only at the seal, when every
// pair of the call has its row. Both facts live in one word per block, changed only by atomic
// additions, so exactly one addition sees the block become complete: the write that fills a
// full block, the write that brings a sealed partial block to its size, or the seal itself when
// every reserved row was already written. That one appends the block to the ready list.
//
// Memory order: a writer's rows (generic stores, then fence.proxy.async for TMA readers) are
// released by its addition; the completing addition is acq_rel, so it acquires every earlier
// addition of the word (one read-modify-write chain), and its release store of the ready-list
// entry carries them to whoever acquires the entry. The CPU model is
// megamoe_rt/schedule/stream_fused.py (FusedStreamModel._block_word). The words: ReadyBlocks
// (interface/stream.cuh).
#pragma once

#include "common/types.cuh"
#include "interface/stream.cuh"
#include "interface/sync.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/special_regs.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::stream {

constexpr u32 kRowsMask = 0xFFFFu;
constexpr u32 kSizeShift = 16;
constexpr u32 kNoPosition = 0xFFFFFFFFu;  // wait_ready_position: the sealed call has no such position

__device__ __forceinline__ bool block_complete(u32 word) {
    const u32 size = word >> kSizeShift;
    return size != 0 && (word & kRowsMask) == size;
}

// One addition to a block's word; the one that completes the block appends it.
__device__ __forceinline__ void add_to_block_word(const ReadyBlocks& rb, u32 block, u32 delta) {
    const u32 old = ptx::atom_add_acq_rel_gpu_u32(rb.state + block, delta);
    if (!block_complete(old) && block_complete(old + delta)) {
        const u32 position = atomicAdd(rb.ready_count, 1u);
        ptx::st_release_gpu_u32(rb.ready + position, block + 1);
    }
}

// `rows` of `block` written (after their stores, and the proxy fence where TMA reads them).
__device__ __forceinline__ void block_rows_written(const ReadyBlocks& rb, u32 block, u32 rows) {
    add_to_block_word(rb, block, rows);
}

// `block` holds `size` rows (1 .. 128): once per block, at the reservation of its last row (a
// full block) or by the seal (the partial block an expert ends with).
__device__ __forceinline__ void block_size_known(const ReadyBlocks& rb, u32 block, u32 size) {
    add_to_block_word(rb, block, size << kSizeShift);
}

// The seal, after every block's size is known: the call has `positions` positions.
__device__ __forceinline__ void seal_ready_list(const ReadyBlocks& rb, u32 positions) {
    ptx::st_release_gpu_u32(rb.sealed, positions + 1);
}

// 0 before the seal, else the call's positions + 1.
__device__ __forceinline__ u32 sealed_word(const ReadyBlocks& rb) { return ptx::ld_acquire_gpu_u32(rb.sealed); }

// The block at `position` once it is complete, or kNoPosition once the seal says the call has
// no such position. A position past the list's capacity never exists (the open task order runs
// past it before the seal): only the seal is waited for, the list is not read there. The
// deadline restarts whenever another block completes, so a long call that keeps completing
// blocks does not trap; on timeout it records and traps naming the position, without printf
// (usable in wgmma kernels).
__device__ __forceinline__ u32 wait_ready_position(const ReadyBlocks& rb, u32 position, const sync::WaitContext& ctx,
                                                   u32 deadline_shift = 0) {
    const u64 timeout_ns = ctx.timeout_ns << deadline_shift;
    const bool listed = position < rb.capacity;
    u64 start = 0, elapsed = 0;
    u32 completed = 0;
    for (u32 spins = 0;; ++spins) {
        if (listed) {
            const u32 entry = ptx::ld_acquire_gpu_u32(rb.ready + position);
            if (entry != 0) return entry - 1;
        }
        const u32 sealed = ptx::ld_acquire_gpu_u32(rb.sealed);
        if (sealed != 0 && position >= sealed - 1) return kNoPosition;
        if (spins == 0) {
            start = ptx::globaltimer_ns();
            completed = ptx::ld_relaxed_gpu_u32(rb.ready_count);
        } else if ((spins & 255u) == 0) {
            const u64 now = ptx::globaltimer_ns();
            const u32 seen = ptx::ld_relaxed_gpu_u32(rb.ready_count);
            if (seen != completed) {  // progress: the wait starts over
                completed = seen;
                start = now;
            }
            elapsed = now - start;
            if (elapsed > timeout_ns) break;
        }
        if (spins > 8) __nanosleep(64);
    }
    // The trap stays out of the loop (sync/deadline_wait.cuh).
    sync::fail_wait(sync::WaitSite::kStreamBlockReady, ctx, position, position + 1,
                    ptx::ld_acquire_gpu_u32(rb.ready_count), elapsed);
    return kNoPosition;
}

}  // namespace megamoe_rt::stream
