// Warpgroup register reallocation and named barriers.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::ptx {

template <u32 kRegs>
__device__ __forceinline__ void setmaxnreg_inc_sync_aligned() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <u32 kRegs>
__device__ __forceinline__ void setmaxnreg_dec_sync_aligned() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Barrier among `num_threads` threads (a multiple of 32) on hardware barrier `id` (1..15;
// 0 is __syncthreads).
__device__ __forceinline__ void bar_sync(u32 id, u32 num_threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Arrive at named barrier `id` without waiting (the others wait with bar_sync on the same count).
__device__ __forceinline__ void bar_arrive(u32 id, u32 num_threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ u32 dynamic_smem_size() {
    u32 size;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(size));
    return size;
}

}  // namespace megamoe_rt::ptx

namespace megamoe_rt::ptx {

// Programmatic dependent launch. Without the launch attribute both are no-ops.
// Waits until the previous kernel in the stream has completed and its writes are visible.
__device__ __forceinline__ void griddepcontrol_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next kernel in the stream start launching (its blocks still need free SMs).
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace megamoe_rt::ptx
