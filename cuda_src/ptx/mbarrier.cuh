// mbarrier wrappers (shared::cta), one per PTX instruction.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::ptx {

__device__ __forceinline__ u32 smem_addr_u32(const void* ptr) {
    return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init_shared(u64* bar, u32 arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr_u32(bar)), "r"(arrive_count) : "memory");
}

// Makes barrier initialisation visible to the async proxy (TMA) and other threads.
__device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx_shared(u64* bar, u32 tx_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr_u32(bar)), "r"(tx_bytes)
                 : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_shared(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr_u32(bar)) : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait_parity_shared(u64* bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "  selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr_u32(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// Waits until the phase with the given parity has completed. Intra-CTA only:
// every arrival it waits for comes from this CTA's own warps or its own TMA.
__device__ __forceinline__ void mbarrier_wait_parity_shared(u64* bar, u32 parity) {
    while (!mbarrier_try_wait_parity_shared(bar, parity)) {
    }
}

}  // namespace megamoe_rt::ptx
