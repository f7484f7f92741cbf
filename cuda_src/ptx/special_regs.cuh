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

// Volatile reads: a persistent kernel re-reads its block index in each role instead of
// keeping it live (and spilled) across a register reallocation.
__device__ __forceinline__ u32 ctaid_x() {
    u32 id;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(id));
    return id;
}

__device__ __forceinline__ u32 nctaid_x() {
    u32 n;
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
    return n;
}

__device__ __forceinline__ u32 smid() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

}  // namespace megamoe_rt::ptx
