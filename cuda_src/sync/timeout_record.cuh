// The record a timed-out wait leaves for the host before it traps.
//
// It lives in mapped pinned host memory (megamoe_rt.runtime.deadlines.TimeoutRecord), so
// the host can still read it after the trap has made the context unusable, and turn it into
// an exception that names the wait. Kernels that run wgmma cannot printf (any call
// serialises their wgmma pipeline); this is how they report.
#pragma once

#include "common/types.cuh"
#include "interface/sync.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/special_regs.cuh"

namespace megamoe_rt::sync {

// How long threads that lost the claim wait for the winner's report before they trap.
constexpr u64 kReportGraceNs = 100'000'000;

// The first timed-out thread of a launch (and of every launch until the host reads and
// resets the record) claims it; false for everyone else and for a null record.
__device__ __forceinline__ bool claim_timeout_record(TimeoutRecord* rec) {
    return rec != nullptr && atomicCAS_system(&rec->state, kRecordEmpty, kRecordWriting) == kRecordEmpty;
}

// The claimant's fields, then the state that lets the host read them.
__device__ __forceinline__ void fill_timeout_record(TimeoutRecord* rec, u32 site, u32 rank, u32 peer, u64 expected,
                                                    u64 seen, u64 elapsed_ns) {
    volatile TimeoutRecord* r = rec;
    r->site = site;
    r->block = blockIdx.x;
    r->thread = threadIdx.x;
    r->rank = rank;
    r->peer = peer;
    r->expected = expected;
    r->seen = seen;
    r->elapsed_ns = elapsed_ns;
    __threadfence_system();
    atomicExch_system(&rec->state, kRecordComplete);
}

// Threads that lost the claim: a trap ends the whole launch, so they hold theirs until the
// claimant's record is complete (bounded: the host may have reset a record in the meantime).
__device__ __forceinline__ void await_timeout_record(TimeoutRecord* rec) {
    if (rec == nullptr) return;
    const u64 start = ptx::globaltimer_ns();
    while (ptx::ld_acquire_sys_u32(&rec->state) != kRecordComplete && ptx::globaltimer_ns() - start < kReportGraceNs)
        __nanosleep(1000);
}

// The record of a timed-out wait: filled by the first thread, awaited by the others.
__device__ __forceinline__ void write_timeout_record(TimeoutRecord* rec, u32 site, u32 rank, u32 peer, u64 expected,
                                                     u64 seen, u64 elapsed_ns) {
    if (claim_timeout_record(rec))
        fill_timeout_record(rec, site, rank, peer, expected, seen, elapsed_ns);
    else
        await_timeout_record(rec);
}

}  // namespace megamoe_rt::sync
