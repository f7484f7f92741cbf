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

// Arrive only where `pred` holds, as one predicated instruction: a C++ branch on a
// lane index would be a divergent path, across which ptxas serialises in-flight wgmma.
__device__ __forceinline__ void mbarrier_arrive_shared_if(u64* bar, bool pred) {
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %1, 0;\n"
        "  @p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "}\n" ::"r"(smem_addr_u32(bar)),
        "r"(static_cast<u32>(pred))
        : "memory");
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

// Waits until the phase with the given parity has completed, with no deadline of its own.
// Only for the math warpgroups' waits, where a deadline check costs (6-7% of a GEMM on the
// per-k-block wait) or spills (NVRTC 13.0), and that another wait with a deadline bounds:
// each use says which. Every other mbarrier wait goes through sync/mbarrier_deadline.cuh.
// The retry loop lives inside one asm block: a C++ loop would be a divergent path to ptxas,
// which then serialises any wgmma still in flight across it.
__device__ __forceinline__ void mbarrier_wait_parity_shared_bounded_elsewhere(u64* bar, u32 parity) {
    asm volatile(
        "{\n"
        "  .reg .pred done;\n"
        "WAIT_%=:\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "  @!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_addr_u32(bar)),
        "r"(parity)
        : "memory");
}

}  // namespace megamoe_rt::ptx
