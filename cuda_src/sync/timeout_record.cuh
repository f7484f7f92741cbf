// The record a timed-out wait leaves for the host before it traps.
//
// It lives in mapped pinned host memory (megamoe_rt.runtime.deadlines.TimeoutRecord), so the host
// can still read it after the trap has made the context unusable, and turn it into an
// exception that names the wait. Kernels that run wgmma cannot printf (any call
// serialises their wgmma pipeline); this is how they report.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::sync {

struct TimeoutRecord {
    u32 state;     // 0 empty, 1 being written, 2 complete (the first timed-out thread wins)
    u32 site;      // WaitSite
    u32 block;
    u32 thread;
    u32 rank;
    u32 peer;
    u64 expected;
    u64 seen;
    u64 elapsed_ns;
};

__device__ __forceinline__ void write_timeout_record(TimeoutRecord* rec, u32 site, u32 rank, u32 peer, u64 expected,
                                                     u64 seen, u64 elapsed_ns) {
    if (rec == nullptr || atomicCAS_system(&rec->state, 0u, 1u) != 0u) return;
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
    atomicExch_system(&rec->state, 2u);
}

}  // namespace megamoe_rt::sync
