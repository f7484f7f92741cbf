// Tiles announced by the grouped GEMM's producer to its math warpgroups through shared memory.
//
// Looking a tile up is a chain of dependent global loads (for the contiguous layout a binary
// search over the group offsets). The producer runs stages ahead of the math warpgroups, so
// it does the lookup off their path: it writes each valid tile into the slot of the tile's
// first stage before arming that stage's full barrier, and the math warpgroups read it there
// once the stage is loaded. They never see the empty tiles. After its last tile the producer
// arms one more stage with no loads and an invalid tile: the end of the sequence.
//
// Ordering: the slot is written with a plain shared store before the producer's arrive on the
// full barrier (release, CTA scope), and read after the math warpgroups' wait on it (acquire),
// so the read sees the write. The slot is rewritten only after the empty barrier says every
// math warp released the stage, which each does after reading the slot.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/mbarrier.cuh"
#include "sync/mbarrier_deadline.cuh"

namespace megamoe_rt::gemm {

static_assert(sizeof(Tile) <= kTileSlotBytes, "a tile does not fit its slot");

// The slot of stage s: after the pipeline's carve-up, where only the grouped GEMM kernel
// reserves room (dynamic_smem_bytes; the fused kernel's routing tables start there instead,
// which is why this lives here and not in SharedStorage).
template <class Cfg>
__device__ __forceinline__ Tile* tile_slot(const SharedStorage<Cfg>& sm, u32 s) {
    return reinterpret_cast<Tile*>(sm.base + Cfg::kOffTileSlots + s * kTileSlotBytes);
}

// Producer thread: waits until the stage that will hold the tile's first k-block is free and
// writes the tile into its slot. produce_tile then arms and fills the stage (its own wait on
// the same phase returns at once).
template <class Cfg>
__device__ __forceinline__ void announce_tile(const SharedStorage<Cfg>& sm, const PipelineState<Cfg::kStages>& st,
                                              const Tile& tile, const sync::MbarrierDeadline& deadline) {
    sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kSmemStageFree>(sm.empty(st.stage), st.phase ^ 1,
                                                                              deadline, st.stage);
    *tile_slot(sm, st.stage) = tile;
}

// Producer thread, after its last tile: the end marker takes one stage with no loads.
template <class Cfg>
__device__ __forceinline__ void announce_end(const SharedStorage<Cfg>& sm, PipelineState<Cfg::kStages>& st,
                                             const sync::MbarrierDeadline& deadline) {
    announce_tile<Cfg>(sm, st, Tile{}, deadline);  // value-initialised: valid == false
    ptx::mbarrier_arrive_shared(sm.full(st.stage));
    st.advance();
}

// Math warpgroups: the next tile, once its first stage is loaded (the end marker's stage
// completes with the producer's arrive alone). No deadline here, as for every loaded-stage
// wait of the math warpgroups (consume_tile): the producer's free-stage waits bound it.
template <class Cfg>
__device__ __forceinline__ Tile announced_tile(const SharedStorage<Cfg>& sm, const PipelineState<Cfg::kStages>& st) {
    ptx::mbarrier_wait_parity_shared_bounded_elsewhere(sm.full(st.stage), st.phase);
    return *tile_slot(sm, st.stage);
}

// Math warpgroups, on the end marker: hand its stage back so the producer's drain completes.
template <class Cfg>
__device__ __forceinline__ void release_end(const SharedStorage<Cfg>& sm, PipelineState<Cfg::kStages>& st,
                                            const MathThread<Cfg>& mt, u32 cta_rank) {
    release_stage<Cfg>(sm, st.stage, mt, cta_rank);
    st.advance();
}

}  // namespace megamoe_rt::gemm
