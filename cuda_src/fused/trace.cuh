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

// The time one data wait takes, added to the block's sum `sum` (a kTraceWait*Ns column) when
// the scope ends. The clock is read only while tracing; several warps of a block may add to
// one sum. Scope it around the wait alone:  { const TracedWait timed(p, kTraceWaitRowsNs); wait(...); }
class TracedWait {
  public:
    __device__ __forceinline__ TracedWait(const FusedParams& p, TraceEvent sum)
        : slot_(p.trace != nullptr ? p.trace + ptx::ctaid_x() * kTraceEvents + sum : nullptr),
          start_(slot_ != nullptr ? ptx::globaltimer_ns() : 0) {}
    __device__ __forceinline__ ~TracedWait() {
        if (slot_ != nullptr) atomicAdd(reinterpret_cast<unsigned long long*>(slot_), ptx::globaltimer_ns() - start_);
    }
    TracedWait(const TracedWait&) = delete;
    TracedWait& operator=(const TracedWait&) = delete;

  private:
    u64* slot_;
    u64 start_;
};

}  // namespace megamoe_rt::fused
