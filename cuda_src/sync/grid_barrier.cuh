// Grid-wide barrier for persistent kernels whose blocks are all resident (cooperative
// launch). Sense-reversing: the last block to arrive resets the count and bumps the
// generation, so the word needs no zeroing between phases or between launches.
#pragma once

#include "common/types.cuh"
#include "ptx/ld_st.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::sync {

// Called by one thread per block once the block's own work for the phase is done (after a
// block-level barrier). Acquire/release at GPU scope: writes before the barrier in any block
// are visible after it in every block.
// One word, at the address the kernel parameter holds: a second word's address (parameter +
// 4) was computed once and held from a kernel's first barrier to its last, through the fused
// kernel's tiles, whose math warpgroups have no register to spare (ptxas spilled it).
constexpr u32 kGridBarrierArrivalBits = 16;  // more than any grid's blocks
constexpr u32 kGridBarrierArrivalMask = (1u << kGridBarrierArrivalBits) - 1;

__device__ __forceinline__ void grid_barrier_acq_rel_gpu(GridBarrierWords* words, u32 num_blocks,
                                                         const WaitContext& ctx) {
    // Arrivals of this barrier only: the generation moves (and the count restarts) only once
    // every block has arrived, so `gen` is this barrier's.
    const u32 before = ptx::atom_add_acq_rel_gpu_u32(&words->state, 1);
    const u32 gen = before >> kGridBarrierArrivalBits;
    const u32 arrived = (before & kGridBarrierArrivalMask) + 1;
    if (arrived == num_blocks) {
        ptx::st_release_gpu_u32(&words->state, (gen + 1) << kGridBarrierArrivalBits);
    } else {
        wait_acquire_gpu_u32(
            &words->state, [gen](u32 v) { return (v >> kGridBarrierArrivalBits) != gen; }, num_blocks,
            WaitSite::kGridBarrier, ctx, arrived, kBarrierWaitShift);
    }
}

}  // namespace megamoe_rt::sync
