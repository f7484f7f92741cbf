// Shared-memory loads/stores with memory order, for hand-offs between warps of one block.
#pragma once

#include "common/types.cuh"
#include "ptx/mbarrier.cuh"

namespace megamoe_rt::ptx {

__device__ __forceinline__ u32 ld_acquire_cta_shared_u32(const u32* ptr) {
    u32 v;
    asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(smem_addr_u32(ptr)) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_cta_shared_u32(u32* ptr, u32 v) {
    asm volatile("st.release.cta.shared::cta.u32 [%0], %1;" ::"r"(smem_addr_u32(ptr)), "r"(v) : "memory");
}

}  // namespace megamoe_rt::ptx
