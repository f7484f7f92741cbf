// Grouped FP8 GEMM for sm_90a: D[g] = A[g] . B[g]^T with 1x128 (or 1x64) A scales and
// 128x128 (or 64x128) B scales, fp32 promotion per scale group, persistent over
// (group, m-block, n-block), then an epilogue policy with its own parameter struct, the
// kernel's second argument (config.cuh). One instantiation per (tile shape, stages, scale
// granularities, group layout, epilogue).
//
// No epilogue header is included here: each variant is compiled with its policy's header
// pre-included (megamoe_rt.kernels.epilogues), so a new epilogue needs no edit of this file.

#include "common/types.cuh"
#include "gemm/config.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/tile_scheduler.cuh"
#include "gemm/tile_slots.cuh"
#include "ptx/cluster.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/sync.cuh"
#include "ptx/tma.cuh"
#include "ptx/warp_uniform.cuh"

namespace megamoe_rt::gemm {

// Register split: the producer warpgroup only issues TMA; the math warpgroups
// hold the wgmma accumulator (64 floats) and the promoted sums (64 per pass) each.
constexpr u32 kProducerRegs = 40;
constexpr u32 kMathRegs = 232;

template <u32 kBlockM, u32 kBlockN, u32 kStages, u32 kASfGran, u32 kBSfN, u32 kOutSfGran, u32 kClusterN,
          GroupLayout kLayout, class Epilogue>
__global__ void __launch_bounds__(
    Config<kBlockM, kBlockN, kStages, kASfGran, kBSfN, kOutSfGran, kClusterN, kLayout, Epilogue>::kNumThreads, 1)
    sm90_fp8_grouped_gemm(const __grid_constant__ GemmParams p,
                          const __grid_constant__ typename Epilogue::Params epilogue_params,
                          const __grid_constant__ ptx::TmaDescriptor tma_a,
                          const __grid_constant__ ptx::TmaDescriptor tma_b,
                          const __grid_constant__ ptx::TmaDescriptor tma_sfa) {
    using Cfg = Config<kBlockM, kBlockN, kStages, kASfGran, kBSfN, kOutSfGran, kClusterN, kLayout, Epilogue>;
    // A group layout the check before this launch refused (and reported): every block of every
    // cluster reads the same word and leaves before any barrier.
    if (p.layout_state != nullptr && *p.layout_state != 0) return;
    extern __shared__ u8 smem_raw[];
    const u32 raw_addr = ptx::smem_addr_u32(smem_raw);
    const SharedStorage<Cfg> sm{smem_raw + ((1024 - raw_addr % 1024) % 1024)};

    if (threadIdx.x == 0) {
        // The host sizes shared memory from the same formula (GemmConfig); a mismatch is a
        // build bug. No printf here: any call in this kernel serialises its wgmma pipeline.
        if (ptx::dynamic_smem_size() < Cfg::kDynamicSmemBytes) __trap();
        for (u32 s = 0; s < kStages; ++s) {
            ptx::mbarrier_init_shared(sm.full(s), 1);
            ptx::mbarrier_init_shared(sm.empty(s), Cfg::kEmptyArrivals);
        }
        ptx::fence_mbarrier_init_release_cluster();
        ptx::prefetch_tensormap(&tma_a);
        ptx::prefetch_tensormap(&tma_b);
        ptx::prefetch_tensormap(&tma_sfa);
    }
    // Barrier initialisation must be visible cluster-wide before a peer arrives or multicasts.
    if constexpr (kClusterN > 1) {
        ptx::barrier_cluster_arrive_release_wait_acquire();
    } else {
        __syncthreads();
    }

    const u32 cta_rank = kClusterN > 1 ? ptx::cluster_ctarank() : 0;
    const u32 num_k_blocks = p.k / Cfg::kBlockK;
    const u32 warpgroup = ptx::warpgroup_index_uniform();
    // Nothing else in this kernel waits: its pipeline waits take the context's deadline as it is.
    const sync::MbarrierDeadline deadline{p.wait, 0};

    if (warpgroup == 0) {
        ptx::setmaxnreg_dec_sync_aligned<kProducerRegs>();
        if (threadIdx.x == 0) {
            // Only the producer walks the schedule; the math warpgroups take the tiles it
            // announces (gemm/tile_slots.cuh).
            const TileScheduler<kBlockM, kBlockN, kLayout, kClusterN> scheduler(p);
            const u32 tile_step = gridDim.x / kClusterN;
            PipelineState<kStages> st;
            for (u32 t = blockIdx.x / kClusterN; t < scheduler.num_tiles; t += tile_step) {
                const Tile tile = scheduler.get(t, cta_rank);
                if (!tile.valid) continue;
                announce_tile<Cfg>(sm, st, tile, deadline);
                produce_tile<Cfg>(tile, num_k_blocks, sm, st, &tma_a, &tma_b, &tma_sfa, cta_rank, deadline);
            }
            announce_end<Cfg>(sm, st, deadline);
            drain_stages<Cfg>(sm, st, deadline);
        }
    } else {
        ptx::setmaxnreg_inc_sync_aligned<kMathRegs>();
        const MathThread<Cfg> mt(warpgroup - 1);
        PipelineState<kStages> st;
        float acc[64];
        PromotedSums<Cfg> out;
        // A tile's sums are stored while the next tile's first wgmmas run (consume_tile's
        // after_first_issue), so the tensor pipe is not idle through the epilogue.
        Tile previous{};  // invalid until the first tile is done
        const auto store_pending = [&] {
            if (!previous.valid) return;
            Epilogue::template store<Cfg>(epilogue_params, previous, mt, sm, out);
        };
        for (;;) {
            const Tile tile = announced_tile<Cfg>(sm, st);
            if (!tile.valid) {
                store_pending();
                release_end<Cfg>(sm, st, mt, cta_rank);
                break;
            }
            consume_tile<Cfg>(p, tile, num_k_blocks, sm, st, mt, acc, out, cta_rank, store_pending);
            previous = tile;
        }
    }
    // A CTA must not exit while its peer may still multicast into it or arrive on its barriers.
    if constexpr (kClusterN > 1) ptx::barrier_cluster_arrive_release_wait_acquire();
}

}  // namespace megamoe_rt::gemm
