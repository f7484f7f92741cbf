// Bulk tensor copies (TMA). Descriptors are encoded on the host
// (megamoe_rt/runtime/tma.py, cuTensorMapEncodeTiled) and passed as __grid_constant__
// kernel parameters.
#pragma once

#include "common/types.cuh"
#include "ptx/mbarrier.cuh"

namespace megamoe_rt::ptx {

// Opaque 128-byte CUtensorMap, same size and alignment as the driver's type.
struct alignas(64) TmaDescriptor {
    u64 opaque[16];
};

__device__ __forceinline__ void prefetch_tensormap(const TmaDescriptor* desc) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(desc) : "memory");
}

// 2-d tile global -> shared; completion is counted in bytes on `bar`.
__device__ __forceinline__ void cp_async_bulk_tensor_2d_global_to_shared(void* dst, const TmaDescriptor* desc, u64* bar,
                                                                         i32 coord_inner, i32 coord_outer) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            smem_addr_u32(dst)),
        "l"(desc), "r"(smem_addr_u32(bar)), "r"(coord_inner), "r"(coord_outer)
        : "memory");
}

}  // namespace megamoe_rt::ptx

namespace megamoe_rt::ptx {

// 2-d tile global -> the same shared-memory offset in every CTA of `cta_mask`; each
// destination CTA's mbarrier (same offset) is credited with the bytes it receives.
__device__ __forceinline__ void cp_async_bulk_tensor_2d_global_to_shared_multicast(void* dst, const TmaDescriptor* desc,
                                                                                   u64* bar, i32 coord_inner,
                                                                                   i32 coord_outer, u16 cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr_u32(dst)),
        "l"(desc), "r"(smem_addr_u32(bar)), "r"(coord_inner), "r"(coord_outer), "h"(cta_mask)
        : "memory");
}

}  // namespace megamoe_rt::ptx
