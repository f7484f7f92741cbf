// Reads of PTX special registers.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::ptx {

// Nanoseconds, GPU-wide; coarse (microsecond updates) but comparable across SMs.
__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u32 smid() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

}  // namespace megamoe_rt::ptx
