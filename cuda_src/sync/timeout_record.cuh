// The record a timed-out wait leaves for the host before it traps.
//
// It lives in mapped pinned host memory (megamoe_rt.runtime.deadlines.TimeoutRecord), so
// the host can still read it after the trap has made the context unusable, and turn it into
// an exception that names the wait. Kernels that run wgmma cannot printf (any call
// serialises their wgmma pipeline); this is how they report.
#pragma once

#include "common/types.cuh"
#include "interface/sync.cuh"

namespace megamoe_rt::sync {

__device__ __forceinline__ void write_timeout_record(TimeoutRecord* rec, u32 site, u32 rank, u32 peer, u64 expected,
                                                     u64 seen, u64 elapsed_ns) {
    if (rec == nullptr || atomicCAS_system(&rec->state, kRecordEmpty, kRecordWriting) != kRecordEmpty) return;
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

}  // namespace megamoe_rt::sync
