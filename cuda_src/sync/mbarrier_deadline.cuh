// Shared-memory pipeline waits (mbarriers) with a deadline.
//
// An mbarrier wait inside a block can stall only behind something else: TMA loads that never
// land, a warp of the block that is itself stuck in a cross-block or cross-rank wait, or a
// bug. The cross-block waits have deadlines of their own, so these take a longer one (the
// caller's `shift`, see deadline_wait.cuh): the first report names the root cause, and a wait
// that nothing else explains still ends in a trap that names it instead of a hang.
//
// The whole wait, the timed-out path included, is one asm block. A C++ loop would be a
// divergent path to ptxas, which then serialises any wgmma still in flight across it; and a
// C++ branch after the loop (even one that only traps) changes ptxas's register plan at every
// call site: it spilled in the fused kernel's producer and math warpgroups, where a wait
// without a deadline did not. In asm, the record is written as fail_wait writes it
// (timeout_record.cuh) and the thread traps.
#pragma once

#include "common/types.cuh"
#include "interface/sync.cuh"
#include "ptx/mbarrier.cuh"
#include "sync/timeout_record.cuh"

namespace megamoe_rt::sync {

// The unit of these deadlines: %globaltimer_hi, 2^32 ns (~4.3 s). A start time and a deadline
// then take one 32-bit register each, read without a shift; the deadlines are a minute or
// more, so the coarse unit loses nothing that matters.
constexpr u32 kMbarrierClockShift = 32;

// Field offsets the asm below writes at. NVRTC 13.0 cannot take offsetof in a constant
// expression, so they are spelled out here; the generated header (interface/sync.cuh) asserts
// the declaration's offsets where NVRTC can, and these are asserted against the same fields.
struct RecordOffsets {
    static constexpr u32 kContextRecord = 8, kContextRank = 16;
    static constexpr u32 kState = 0, kSite = 4, kBlock = 8, kThread = 12, kRank = 16, kPeer = 20;
    static constexpr u32 kExpected = 24, kSeen = 32, kElapsed = 40;
};
MEGAMOE_RT_ASSERT_OFFSET(WaitContext, record, RecordOffsets::kContextRecord, "WaitContext::record moved");
MEGAMOE_RT_ASSERT_OFFSET(WaitContext, rank, RecordOffsets::kContextRank, "WaitContext::rank moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, state, RecordOffsets::kState, "TimeoutRecord::state moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, site, RecordOffsets::kSite, "TimeoutRecord::site moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, block, RecordOffsets::kBlock, "TimeoutRecord::block moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, thread, RecordOffsets::kThread, "TimeoutRecord::thread moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, rank, RecordOffsets::kRank, "TimeoutRecord::rank moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, peer, RecordOffsets::kPeer, "TimeoutRecord::peer moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, expected, RecordOffsets::kExpected, "TimeoutRecord::expected moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, seen, RecordOffsets::kSeen, "TimeoutRecord::seen moved");
MEGAMOE_RT_ASSERT_OFFSET(TimeoutRecord, elapsed_ns, RecordOffsets::kElapsed, "TimeoutRecord::elapsed_ns moved");

// The deadline every mbarrier wait of a kernel gets: its WaitContext and how many powers of
// two behind the context's deadline it comes (kIntraBlockWaitShift in kernels that also wait
// across blocks). Both are constants of the kernel once inlined (the context is a kernel
// parameter), and the wait reads the timeout only on its timed path: nothing stays live in a
// register across the loops that wait, which ptxas would have to find room for (the fused
// kernel's producer warpgroup runs in 72 registers; a limit held per thread spilled there
// with NVRTC 13.0).
struct MbarrierDeadline {
    const WaitContext& ctx;
    u32 shift;
};

// Waits until the phase with `parity` of `bar` has completed. Past the deadline the first
// timed-out thread of the launch fills the TimeoutRecord (`site`; `peer`: which stage or
// slot; expected: the parity), and every timed-out thread traps once the record is complete
// (a whole warpgroup times out on the same barrier at once). The clock is read only after
// a try_wait has come back unsuccessful (each try suspends the thread for a while first), so
// the path that finds the phase complete costs one branch more than the plain wait.
template <WaitSite kSite>
__device__ __forceinline__ void mbarrier_wait_parity_shared_or_trap(u64* bar, u32 parity,
                                                                    const MbarrierDeadline& deadline, u32 peer) {
    asm volatile(
        "{\n"
        "  .reg .pred ok, waiting, lost;\n"
        "  .reg .u32 t0, dt, v, lim;\n"
        "  .reg .u64 rec, w;\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 ok, [%0], %1;\n"
        "  @ok bra DONE_%=;\n"
        "  mov.u32 t0, %%globaltimer_hi;\n"
        // The limit in clock units: (timeout_ns << shift) >> 32, rounded up, saturated.
        "  ld.u64 w, [%3];\n"
        "  shl.b64 w, w, %2;\n"
        "  shr.u64 w, w, %18;\n"
        "  min.u64 w, w, 4294967294;\n"
        "  cvt.u32.u64 lim, w;\n"
        "  add.u32 lim, lim, 1;\n"
        "RETRY_%=:\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 ok, [%0], %1;\n"
        "  @ok bra DONE_%=;\n"
        "  mov.u32 dt, %%globaltimer_hi;\n"
        "  sub.u32 dt, dt, t0;\n"
        "  setp.le.u32 waiting, dt, lim;\n"
        "  @waiting bra RETRY_%=;\n"
        // Timed out: claim the record (state empty -> writing), fill it, mark it complete.
        "  ld.u64 rec, [%3 + %6];\n"
        "  setp.eq.u64 lost, rec, 0;\n"
        "  @lost bra TRAP_%=;\n"
        "  atom.sys.cas.b32 v, [rec + %8], %15, %16;\n"
        "  setp.ne.u32 lost, v, %15;\n"
        "  @lost bra GRACE_%=;\n"
        "  mov.u32 v, %5;\n"
        "  st.volatile.u32 [rec + %9], v;\n"
        "  mov.u32 v, %%ctaid.x;\n"
        "  st.volatile.u32 [rec + %10], v;\n"
        "  mov.u32 v, %%tid.x;\n"
        "  st.volatile.u32 [rec + %11], v;\n"
        "  ld.u32 v, [%3 + %7];\n"
        "  st.volatile.u32 [rec + %12], v;\n"
        "  st.volatile.u32 [rec + %13], %4;\n"
        "  cvt.u64.u32 w, %1;\n"
        "  st.volatile.u64 [rec + %14], w;\n"
        "  xor.b64 w, w, 1;\n"
        "  st.volatile.u64 [rec + %19], w;\n"
        "  cvt.u64.u32 w, dt;\n"
        "  shl.b64 w, w, %18;\n"
        "  st.volatile.u64 [rec + %20], w;\n"
        "  membar.sys;\n"
        "  atom.sys.exch.b32 v, [rec + %8], %17;\n"
        "  bra TRAP_%=;\n"
        // Lost the claim: a trap ends the whole launch, so hold it until the claimant's record
        // is complete (at most kReportGraceNs, timed on %globaltimer_lo).
        "GRACE_%=:\n"
        "  mov.u32 t0, %%globaltimer_lo;\n"
        "GRACE_POLL_%=:\n"
        "  ld.acquire.sys.u32 v, [rec + %8];\n"
        "  setp.eq.u32 ok, v, %17;\n"
        "  @ok bra TRAP_%=;\n"
        "  nanosleep.u32 1000;\n"
        "  mov.u32 dt, %%globaltimer_lo;\n"
        "  sub.u32 dt, dt, t0;\n"
        "  setp.lt.u32 waiting, dt, %21;\n"
        "  @waiting bra GRACE_POLL_%=;\n"
        "TRAP_%=:\n"
        "  trap;\n"
        "DONE_%=:\n"
        "}\n" ::"r"(ptx::smem_addr_u32(bar)),
        "r"(parity), "r"(deadline.shift), "l"(&deadline.ctx), "r"(peer), "n"(static_cast<u32>(kSite)),
        "n"(RecordOffsets::kContextRecord), "n"(RecordOffsets::kContextRank), "n"(RecordOffsets::kState),
        "n"(RecordOffsets::kSite), "n"(RecordOffsets::kBlock), "n"(RecordOffsets::kThread), "n"(RecordOffsets::kRank),
        "n"(RecordOffsets::kPeer), "n"(RecordOffsets::kExpected), "n"(kRecordEmpty), "n"(kRecordWriting),
        "n"(kRecordComplete), "n"(kMbarrierClockShift), "n"(RecordOffsets::kSeen), "n"(RecordOffsets::kElapsed),
        "n"(static_cast<u32>(kReportGraceNs))
        : "memory");
}

}  // namespace megamoe_rt::sync
