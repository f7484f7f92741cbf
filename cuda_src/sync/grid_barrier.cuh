// Grid-wide barrier for persistent kernels whose blocks are all resident (cooperative
// launch). Sense-reversing: the last block to arrive resets the count and bumps the
// generation, so the words need no zeroing between phases or between launches.
#pragma once

#include "common/types.cuh"
#include "ptx/ld_st.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::sync {

// Called by one thread per block once the block's own work for the phase is done (after a
// block-level barrier). Acquire/release at GPU scope: writes before the barrier in any block
// are visible after it in every block.
__device__ __forceinline__ void grid_barrier_acq_rel_gpu(GridBarrierWords* words, u32 num_blocks,
                                                         const WaitContext& ctx) {
    // The generation can only move once this block has arrived, so this is the current one.
    const u32 gen = ptx::ld_relaxed_gpu_u32(&words->generation);
    const u32 arrived = ptx::atom_add_acq_rel_gpu_u32(&words->count, 1) + 1;
    if (arrived == num_blocks) {
        ptx::st_relaxed_gpu_u32(&words->count, 0);
        ptx::st_release_gpu_u32(&words->generation, gen + 1);
    } else {
        wait_acquire_gpu_u32(
            &words->generation, [gen](u32 v) { return v != gen; }, num_blocks, WaitSite::kGridBarrier, ctx, arrived,
            kBarrierWaitShift);
    }
}

}  // namespace megamoe_rt::sync
