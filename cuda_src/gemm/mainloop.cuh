// The FP8 tile loop shared by every GEMM in the project: a TMA producer and
// wgmma consumers meeting on full/empty mbarriers, with fp32 promotion of the
// partial sums per A-scale group (acc += partial * sa[row] * sb[n-chunk]).
#pragma once

#include "common/types.cuh"
#include "gemm/config.cuh"
#include "gemm/params.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/cluster.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "sync/mbarrier_deadline.cuh"

namespace megamoe_rt::gemm {

template <class Cfg>
struct SharedStorage {
    u8* base;  // 1024-byte aligned

    __device__ __forceinline__ u8* a(u32 s) const { return base + Cfg::kOffA + s * Cfg::kSmemABytes; }
    __device__ __forceinline__ u8* b(u32 s) const { return base + Cfg::kOffB + s * Cfg::kSmemBBytes; }
    __device__ __forceinline__ float* sfa(u32 s) const {
        return reinterpret_cast<float*>(base + Cfg::kOffSfa + s * Cfg::kSfaStageStride);
    }
    __device__ __forceinline__ float* scratch() const { return reinterpret_cast<float*>(base + Cfg::kOffScratch); }
    __device__ __forceinline__ u64* full(u32 s) const { return reinterpret_cast<u64*>(base + Cfg::kOffBarriers) + s; }
    __device__ __forceinline__ u64* empty(u32 s) const {
        return reinterpret_cast<u64*>(base + Cfg::kOffBarriers) + Cfg::kStages + s;
    }
};

template <u32 kStages>
struct PipelineState {
    u32 stage = 0;
    u32 phase = 0;
    __device__ __forceinline__ void advance() {
        if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
        }
    }
};

// Keeps the compiler from moving accumulator reads across wgmma waits: the
// registers become operands of an (empty) volatile asm ordered after the wait.
__device__ __forceinline__ void fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }

template <class Cfg>
__device__ __forceinline__ void produce_tile(const Tile& tile, u32 num_k_blocks, const SharedStorage<Cfg>& sm,
                                             PipelineState<Cfg::kStages>& st, const ptx::TmaDescriptor* tma_a,
                                             const ptx::TmaDescriptor* tma_b, const ptx::TmaDescriptor* tma_sfa,
                                             u32 cta_rank, const sync::MbarrierDeadline& deadline) {
    // Unrolled as NVVM unrolls it for a short wait: the deadline's asm, with its cold path, is
    // long enough that the cost model would leave the loop rolled (GEMMs 7% slower, measured).
#pragma unroll 4
    for (u32 kb = 0; kb < num_k_blocks; ++kb) {
        // The first pass finds every stage free: waiting on the parity before phase 0 returns at once.
        sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kSmemStageFree>(sm.empty(st.stage), st.phase ^ 1,
                                                                                  deadline, st.stage);
        u64* full = sm.full(st.stage);
        ptx::mbarrier_arrive_expect_tx_shared(full, Cfg::kStageTxBytes);
        const i32 k0 = static_cast<i32>(kb * Cfg::kBlockK);
        if constexpr (Cfg::kClusterN == 2) {
            // This CTA's half of the A tile goes to both CTAs of the pair. The stage was
            // released by the consumers of both (the empty barrier counts them all).
            constexpr u32 kHalfRows = Cfg::kBlockM / 2;
            ptx::cp_async_bulk_tensor_2d_global_to_shared_multicast(
                sm.a(st.stage) + cta_rank * kHalfRows * Cfg::kBlockK, tma_a, full, k0,
                static_cast<i32>(tile.a_row0 + cta_rank * kHalfRows), static_cast<u16>(0b11));
        } else {
            ptx::cp_async_bulk_tensor_2d_global_to_shared(sm.a(st.stage), tma_a, full, k0,
                                                          static_cast<i32>(tile.a_row0));
        }
        ptx::cp_async_bulk_tensor_2d_global_to_shared(sm.b(st.stage), tma_b, full, k0, static_cast<i32>(tile.b_row0));
        ptx::cp_async_bulk_tensor_2d_global_to_shared(sm.sfa(st.stage), tma_sfa, full, static_cast<i32>(tile.a_row0),
                                                      static_cast<i32>(kb * Cfg::kSfaRowsPerStage));
        st.advance();
    }
}

// The producer after its last tile: waits, with the deadline, until the math warpgroups have
// released every stage it filled. This is what bounds their waits for loaded stages (which
// have no deadline of their own, see consume_tile) once no further fill would wait for them.
template <class Cfg>
__device__ __forceinline__ void drain_stages(const SharedStorage<Cfg>& sm, PipelineState<Cfg::kStages> st,
                                             const sync::MbarrierDeadline& deadline) {
    for (u32 i = 0; i < Cfg::kStages; ++i) {
        sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kSmemStageFree>(sm.empty(st.stage), st.phase ^ 1,
                                                                                  deadline, st.stage);
        st.advance();
    }
}

// Position of this thread's accumulator rows inside the tile.
template <class Cfg>
struct MathThread {
    u32 wg_m, wg_n, lane, row0;  // row0: first of the thread's two rows (row0, row0 + 8), tile-local
    u32 pass = 0;                // which 128-column pass of the warpgroup (Cfg::kNPasses > 1)
    __device__ __forceinline__ explicit MathThread(u32 math_wg) {
        wg_m = math_wg / Cfg::kWgN;
        wg_n = math_wg % Cfg::kWgN;
        lane = threadIdx.x % 32;
        row0 = wg_m * Cfg::kWgTileM + ((threadIdx.x / 32) % 4) * 16 + lane / 4;
    }
    // The same thread on pass `p` of its columns: an epilogue gets the thread at pass 0 and
    // takes each pass's columns through this (col0 of the thread it was handed is pass 0's).
    __device__ __forceinline__ MathThread on_pass(u32 p) const {
        MathThread t = *this;
        t.pass = p;
        return t;
    }
    // First column of this warpgroup's columns within the tile.
    __device__ __forceinline__ u32 tile_col0() const { return (wg_n * Cfg::kNPasses + pass) * Cfg::kWgTileN; }
    // First output column of this pass's 64 x 128 piece, within the group.
    __device__ __forceinline__ u32 col0(const Tile& tile) const { return tile.n0 + tile_col0(); }
    // Column of accumulator pair i (0..15) relative to col0.
    __device__ __forceinline__ u32 pair_col(u32 i) const { return 8 * i + 2 * (lane % 4); }
};

// One promotion step: the wgmmas of A-scale group `h` of the k-block in `stage`.
template <class Cfg>
__device__ __forceinline__ void issue_step(const SharedStorage<Cfg>& sm, u32 stage, u32 h, u32 a_offset, u32 b_offset,
                                           float (&acc)[64]) {
    const u64 desc_a = ptx::smem_desc_k_major_sw128(sm.a(stage) + a_offset);
    const u64 desc_b = ptx::smem_desc_k_major_sw128(sm.b(stage) + b_offset);
#pragma unroll
    for (int i = 0; i < 64; ++i) fence_operand(acc[i]);
    ptx::wgmma_fence_sync_aligned();
#pragma unroll
    for (u32 k = 0; k < Cfg::kWgmmaPerPromotion; ++k) {
        const u32 bytes = (h * Cfg::kWgmmaPerPromotion + k) * Cfg::kWgmmaK;
        ptx::wgmma_m64n128k32_f32_e4m3_e4m3(acc, ptx::smem_desc_advance_bytes(desc_a, bytes),
                                            ptx::smem_desc_advance_bytes(desc_b, bytes), k > 0);
    }
    ptx::wgmma_commit_group_sync_aligned();
}

// The scales of one promotion step of this thread: sa[row] * sb for its two rows (row0, row0 + 8),
// and with 64-column B scales a second pair for the upper eight column pairs (columns 64..127).
struct StepScales {
    float lo0, lo1, hi0, hi1;
};

// Reads the step's A scales from the loaded stage and multiplies in the B scales. Called right
// after the stage's full-barrier wait, before the step's wgmmas are issued: the shared-memory
// loads and the products then run under the wgmmas instead of after their wait (where the
// promotion's first FMUL waited on the LDS: the largest stall of the promotion, bench/NOTES.md).
template <class Cfg>
__device__ __forceinline__ StepScales step_scales(const SharedStorage<Cfg>& sm, u32 stage, u32 h,
                                                  const MathThread<Cfg>& mt, float sb_lo, float sb_hi) {
    const float* sfa = sm.sfa(stage) + h * Cfg::kBlockM;
    const float sa0 = sfa[mt.row0];
    const float sa1 = sfa[mt.row0 + 8];
    StepScales s;
    s.lo0 = sa0 * sb_lo;
    s.lo1 = sa1 * sb_lo;
    s.hi0 = Cfg::kBSfN == 64 ? sa0 * sb_hi : s.lo0;
    s.hi1 = Cfg::kBSfN == 64 ? sa1 * sb_hi : s.lo1;
    return s;
}

// out += acc * sa[row] * sb: fp32 promotion of one step's partial sums.
template <class Cfg>
__device__ __forceinline__ void promote_step(const StepScales& sc, float (&acc)[64], float (&out)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) fence_operand(acc[i]);
#pragma unroll
    for (u32 i = 0; i < 16; ++i) {
        const float s0 = i >= 8 ? sc.hi0 : sc.lo0, s1 = i >= 8 ? sc.hi1 : sc.lo1;
        out[4 * i + 0] += acc[4 * i + 0] * s0;
        out[4 * i + 1] += acc[4 * i + 1] * s0;
        out[4 * i + 2] += acc[4 * i + 2] * s1;
        out[4 * i + 3] += acc[4 * i + 3] * s1;
    }
}

// Every lane has read its scales and its warp's wgmmas on the stage are complete: hand the
// stage back. With a cluster, the peer's producer also writes this stage (its A half).
template <class Cfg>
__device__ __forceinline__ void release_stage(const SharedStorage<Cfg>& sm, u32 stage, const MathThread<Cfg>& mt,
                                              u32 cta_rank) {
    __syncwarp();
    ptx::mbarrier_arrive_shared_if(sm.empty(stage), mt.lane == 0);
    if constexpr (Cfg::kClusterN == 2)
        ptx::mbarrier_arrive_shared_cluster_remote_if(sm.empty(stage), cta_rank ^ 1, mt.lane == 0);
}

// The promoted sums of one thread: a 64-float fragment per 128-column pass.
template <class Cfg>
using PromotedSums = float[Cfg::kNPasses * 64];

// One pass's fragment of the promoted sums (what an epilogue stores).
template <class Cfg>
__device__ __forceinline__ const float (&pass_sums(const PromotedSums<Cfg>& out, u32 pass))[64] {
    return *reinterpret_cast<const float (*)[64]>(out + 64 * pass);
}

// Where a tile's mainloop leaves the math warpgroups free while its first wgmmas run: between
// their issue and their wait. The grouped GEMM stores the previous tile's sums there (its
// promoted sums are still in `out`, which is zeroed right after); the fused kernel does nothing.
struct NothingAfterFirstIssue {
    __device__ __forceinline__ void operator()() const {}
};
template <class F>
inline constexpr bool kRunsAfterFirstIssue = true;
template <>
inline constexpr bool kRunsAfterFirstIssue<NothingAfterFirstIssue> = false;

// One k-block of a tile: B scales, the loaded-stage wait, per promotion step its scales, wgmmas
// and promotion, then the stage's release. kFirst: the tile's first k-block, which runs
// `after_first_issue` and zeroes `out` once its first step's wgmmas are in flight (h and ps are
// unrolled, so that point is fixed at compile time and no branch of the loop's own decides
// whether it runs). The hook itself may branch (the stores' row checks): ptxas keeps the wgmmas
// in flight across it as long as it touches no accumulator register, which tests/cpu/test_jit.py
// checks through ptxas's C7518 warning.
template <class Cfg, bool kFirst, class AfterFirstIssue>
__device__ __forceinline__ void consume_k_block(const float* sfb, u32 num_k_blocks, u32 kb, u32 a_offset, u32 b_offset,
                                                const SharedStorage<Cfg>& sm, PipelineState<Cfg::kStages>& st,
                                                const MathThread<Cfg>& mt, float (&acc)[64], PromotedSums<Cfg>& out,
                                                u32 cta_rank, AfterFirstIssue& after_first_issue) {
    constexpr u32 kPasses = Cfg::kNPasses;
    // A pass's B scales start kWgTileN / kBSfN scale columns after the previous pass's.
    constexpr u32 kSfbPassStride = Cfg::kWgTileN / Cfg::kBSfN;
    constexpr u32 kSteps = Cfg::kSfaRowsPerStage;
    // B scales come straight from global (L2-resident, a few words per k-block), written
    // before the wait so their latency can hide behind it. ptxas schedules the LDG after the
    // wait's TRYWAIT and the k-block's first QGMMA all the same (SASS of every variant), so
    // the first promotion FMUL waits on it behind only this k-block's wgmmas (bench/NOTES.md).
    float sb_lo[kPasses], sb_hi[kPasses];
#pragma unroll
    for (u32 ps = 0; ps < kPasses; ++ps) {
        const float* sfb_pass = sfb + ps * kSfbPassStride * num_k_blocks;
        sb_lo[ps] = ptx::ld_global_nc_f32(sfb_pass + kb);
        sb_hi[ps] = Cfg::kBSfN == 64 ? ptx::ld_global_nc_f32(sfb_pass + num_k_blocks + kb) : sb_lo[ps];
    }
    // No deadline here: the math warpgroups wait once per k-block, and a deadline check in
    // this loop (never taken) made the plain GEMM 6-7% slower (bench/NOTES.md). The wait is
    // bounded all the same: loads that never land leave their stage unreleased, so the
    // producer's wait for it (or its drain_stages at the end) times out and traps.
    ptx::mbarrier_wait_parity_shared_bounded_elsewhere(sm.full(st.stage), st.phase);
#pragma unroll
    for (u32 h = 0; h < kSteps; ++h) {
#pragma unroll
        for (u32 ps = 0; ps < kPasses; ++ps) {
            const StepScales sc = step_scales<Cfg>(sm, st.stage, h, mt, sb_lo[ps], sb_hi[ps]);
            issue_step<Cfg>(sm, st.stage, h, a_offset, b_offset + ps * Cfg::kWgTileN * Cfg::kBlockK, acc);
            if constexpr (kFirst) {
                if (h == 0 && ps == 0) {
                    after_first_issue();
#pragma unroll
                    for (int i = 0; i < 64 * static_cast<int>(kPasses); ++i) out[i] = 0.0f;
                }
            }
            ptx::wgmma_wait_group_sync_aligned<0>();
            promote_step<Cfg>(sc, acc, *reinterpret_cast<float (*)[64]>(out + 64 * ps));
        }
    }
    release_stage<Cfg>(sm, st.stage, mt, cta_rank);
    st.advance();
}

template <class Cfg, class AfterFirstIssue = NothingAfterFirstIssue>
__device__ __forceinline__ void consume_tile(const GemmParams& p, const Tile& tile, u32 num_k_blocks,
                                             const SharedStorage<Cfg>& sm, PipelineState<Cfg::kStages>& st,
                                             const MathThread<Cfg>& mt, float (&acc)[64], PromotedSums<Cfg>& out,
                                             u32 cta_rank, AfterFirstIssue after_first_issue = {}) {
    const u32 sfb_per_group = p.n / Cfg::kBSfN;
    const float* sfb =
        p.sfb + (static_cast<u64>(tile.group) * sfb_per_group + mt.col0(tile) / Cfg::kBSfN) * num_k_blocks;
    const u32 a_offset = mt.wg_m * Cfg::kWgTileM * Cfg::kBlockK;
    const u32 b_offset = mt.tile_col0() * Cfg::kBlockK;
    if constexpr (kRunsAfterFirstIssue<AfterFirstIssue>) {
        consume_k_block<Cfg, true>(sfb, num_k_blocks, 0, a_offset, b_offset, sm, st, mt, acc, out, cta_rank,
                                   after_first_issue);
        for (u32 kb = 1; kb < num_k_blocks; ++kb)
            consume_k_block<Cfg, false>(sfb, num_k_blocks, kb, a_offset, b_offset, sm, st, mt, acc, out, cta_rank,
                                        after_first_issue);
    } else {
        // Nothing to overlap: one loop over every k-block (peeling the first costs the fused
        // kernel its uniform descriptors, tests/cpu/test_jit.py).
#pragma unroll
        for (int i = 0; i < 64 * static_cast<int>(Cfg::kNPasses); ++i) out[i] = 0.0f;
        for (u32 kb = 0; kb < num_k_blocks; ++kb)
            consume_k_block<Cfg, false>(sfb, num_k_blocks, kb, a_offset, b_offset, sm, st, mt, acc, out, cta_rank,
                                        after_first_issue);
    }
}

}  // namespace megamoe_rt::gemm
