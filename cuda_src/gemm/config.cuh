// Compile-time tile configuration and shared-memory carve-up of the grouped FP8 GEMM.
//
// A CTA is one producer warpgroup (one thread issues TMA) and one or two math
// warpgroups, computing with wgmma m64n128k32. Each math warpgroup owns 64 rows and
// kNPasses x 128 columns of the tile: BLOCK_M 128 splits rows between two warpgroups,
// 64 x 256 splits columns, 64 x 128 uses one; 128 x 256 splits rows and each warpgroup
// computes its 256 columns in two passes of 128 through one accumulator fragment (one
// k-block's A read twice, B's shared-memory traffic per FLOP two thirds of 128 x 128's:
// bench/NOTES.md). Optionally two CTAs form a cluster along N that shares (multicasts)
// the A tile.
#pragma once

#include "common/types.cuh"
#include "gemm/params.cuh"

namespace megamoe_rt::gemm {

template <u32 kBlockM_, u32 kBlockN_, u32 kStages_, u32 kASfGran_, u32 kBSfN_, u32 kOutSfGran_, u32 kClusterN_,
          GroupLayout kLayout_, class Epilogue_>
struct Config {
    static constexpr u32 kBlockM = kBlockM_;
    static constexpr u32 kBlockN = kBlockN_;
    static constexpr u32 kBlockK = gemm::kBlockK;  // e4m3: one 128-byte swizzled row
    static constexpr u32 kStages = kStages_;
    static constexpr u32 kASfGran = kASfGran_;      // A scales per 64 or 128 K elements
    static constexpr u32 kBSfN = kBSfN_;            // B scales per 64 or 128 output columns
    static constexpr u32 kOutSfGran = kOutSfGran_;  // SwiGLU epilogue: requant group along the output
    // CTAs per cluster along N: a pair computes neighbouring n-blocks of one m-block and
    // each loads half of the shared A tile, multicast to both (half the A traffic). Waits on
    // the peer are bounded like every pipeline wait, by the producers' deadlines.
    static constexpr u32 kClusterN = kClusterN_;
    static constexpr GroupLayout kLayout = kLayout_;
    // What the math warpgroups do with a finished tile: a policy type with its parameter struct
    // (the kernel's second argument, declared in megamoe_rt/kernels/interface/gemm.py) and
    //   using Params = ...;
    //   template <class Cfg> static void store(const Params&, const Tile&, const MathThread<Cfg>&,
    //                                          const SharedStorage<Cfg>&, const PromotedSums<Cfg>& out);
    // out holds the thread's promoted fp32 sums, one 64-float fragment per 128-column pass
    // (pass_sums); the MathThread is at pass 0, so a policy takes pass p's columns from
    // mt.on_pass(p).
    // Each policy lives in its own header (gemm/epilogue_*.cuh) and checks the tile
    // configurations it supports itself.
    using Epilogue = Epilogue_;

    static constexpr u32 kWgTileM = 64, kWgTileN = 128, kWgmmaK = 32;
    static constexpr u32 kWgM = kBlockM / kWgTileM;
    // At most two math warpgroups: columns are split only where rows are not.
    static constexpr u32 kWgN = (kBlockN / kWgTileN) < (2 / kWgM) ? (kBlockN / kWgTileN) : (2 / kWgM);
    static constexpr u32 kNPasses = kBlockN / (kWgN * kWgTileN);  // 128-column passes per warpgroup
    static constexpr u32 kNumMathWarpgroups = kWgM * kWgN;
    static constexpr u32 kNumMathThreads = kNumMathWarpgroups * 128;
    static constexpr u32 kNumThreads = 128 + kNumMathThreads;

    // Promotions per k-block: one per A-scale group.
    static constexpr u32 kSfaRowsPerStage = kBlockK / kASfGran;
    static constexpr u32 kWgmmaPerPromotion = kASfGran / kWgmmaK;

    static constexpr u32 kSmemABytes = kBlockM * kBlockK;
    static constexpr u32 kSmemBBytes = kBlockN * kBlockK;
    static constexpr u32 kSmemSfaBytes = kSfaRowsPerStage * kBlockM * 4;
    // Stage slots always have room for 64-wide scale groups, so GEMMs that differ only in
    // their A-scale granularity share one carve-up (the fused kernel runs L1 and L2 on it).
    static constexpr u32 kSfaStageStride = (kBlockK / 64) * kBlockM * 4;
    // What TMA delivers per stage, and what the host counts with (generated from one formula).
    static constexpr u32 kStageTxBytes = stage_tx_bytes(kBlockM, kBlockN, kASfGran);
    static_assert(kStageTxBytes == kSmemABytes + kSmemBBytes + kSmemSfaBytes, "a stage's loads and expect-tx differ");

    // Carve-up from a 1024-byte aligned base: A stages, B stages (each tile
    // 1024-aligned for the 128-byte swizzle), A-scale stages, epilogue scratch,
    // then the full/empty barriers.
    static constexpr u32 kOffA = 0;
    static constexpr u32 kOffB = kOffA + kStages * kSmemABytes;
    static constexpr u32 kOffSfa = kOffB + kStages * kSmemBBytes;
    static constexpr u32 kOffScratch = kOffSfa + kStages * kSfaStageStride;
    static constexpr u32 kScratchBytes = kEpilogueScratchBytes;  // per-row amax exchange between N-split warpgroups
    static constexpr u32 kOffBarriers = kOffScratch + kScratchBytes;
    static constexpr u32 kSmemBytes = kOffBarriers + kStages * kBarrierBytesPerStage;
    static constexpr u32 kSmemAlignSlack = gemm::kSmemAlignSlack;  // the dynamic base is only 16-byte aligned
    // The carve-up above must add up to exactly pipeline_smem_bytes() (the same generated
    // formula the host sizes with; the fused kernel's tables start after it).
    static_assert(kSmemBytes + kSmemAlignSlack == pipeline_smem_bytes(kBlockM, kBlockN, kStages),
                  "the carve-up differs from the host's size");
    // The grouped GEMM kernel adds one tile slot per stage after the pipeline; the host reserves
    // dynamic_smem_bytes() for it.
    static constexpr u32 kOffTileSlots = kSmemBytes;
    static constexpr u32 kDynamicSmemBytes = dynamic_smem_bytes(kBlockM, kBlockN, kStages);
    static_assert(kOffTileSlots + kStages * kTileSlotBytes + kSmemAlignSlack == kDynamicSmemBytes,
                  "the tile slots differ from the host's size");
    static_assert(kScratchBytes >= 2 * kWgTileM * 4, "epilogue scratch holds a per-row amax per N-split warpgroup");

    static_assert(kBlockM == 64 || kBlockM == 128, "BLOCK_M must be 64 or 128");
    static_assert(kBlockN == 128 || kBlockN == 256, "BLOCK_N must be 128 or 256");
    static_assert(kNumMathWarpgroups == 1 || kNumMathWarpgroups == 2, "one or two math warpgroups");
    static_assert(kNPasses == 1 || (kNPasses == 2 && kClusterN == 1), "two passes only for 128 x 256, single CTAs");
    static_assert(kASfGran == 64 || kASfGran == 128, "A scale granularity must be 64 or 128");
    static_assert(kBSfN == 64 || kBSfN == 128, "B scale granularity must be 64 or 128");
    static_assert(kSmemABytes % 1024 == 0 && kSmemBBytes % 1024 == 0, "swizzled tiles must stay 1024-aligned");
    static_assert(kStages >= 2, "at least two pipeline stages");
    static_assert(kClusterN == 1 || kClusterN == 2, "clusters of one or two CTAs along N");
    static constexpr u32 kEmptyArrivals = kNumMathWarpgroups * 4 * kClusterN;  // one per math warp per CTA
    static_assert(kDynamicSmemBytes <= kSmemLimit, "exceeds the 227 KiB shared-memory limit");
    static_assert(kOutSfGran == 64 || kOutSfGran == 128, "requant granularity must be 64 or 128");
};

}  // namespace megamoe_rt::gemm
