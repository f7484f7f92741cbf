// The fused kernel's optional per-block stage trace (FusedParams::trace: kTraceEvents
// %globaltimer stamps per block, read by megamoe_rt/cli/trace.py).
#pragma once

#include "common/types.cuh"
#include "interface/fused.cuh"
#include "ptx/special_regs.cuh"

namespace megamoe_rt::fused {

__device__ __forceinline__ void trace(const FusedParams& p, TraceEvent event) {
    if (p.trace != nullptr) p.trace[ptx::ctaid_x() * kTraceEvents + event] = ptx::globaltimer_ns();
}

// The producer, before each L1 tile: stamps the first.
__device__ __forceinline__ void trace_first_l1(const FusedParams& p, bool& traced) {
    if (!traced) {
        trace(p, kTraceFirstL1);
        traced = true;
    }
}

}  // namespace megamoe_rt::fused
