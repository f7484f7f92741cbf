// Thread-block-cluster primitives: rank, cluster-wide barrier, remote mbarrier arrival.
#pragma once

#include "common/types.cuh"
#include "ptx/mbarrier.cuh"

namespace megamoe_rt::ptx {

__device__ __forceinline__ u32 cluster_ctarank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// All threads of all CTAs in the cluster; release/acquire orders shared-memory
// state (barrier initialisation, last remote arrivals) across the cluster.
__device__ __forceinline__ void barrier_cluster_arrive_release_wait_acquire() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the mbarrier at the same shared-memory offset in CTA `cta_rank` of the cluster,
// with the instruction's default semantics (release at CTA scope). Used by consumers to
// hand a stage back to a peer's producer: what must be ordered is this warp's completed
// wgmma reads before the peer's next TMA write, which the barrier round trip already
// orders; a cluster-scope release would also drain every outstanding global store of
// the warp on each k-block.
// Only where `pred` holds (one predicated instruction, see mbarrier_arrive_shared_if).
__device__ __forceinline__ void mbarrier_arrive_shared_cluster_remote_if(u64* local_bar, u32 cta_rank, bool pred) {
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  .reg .b32 remote;\n"
        "  setp.ne.b32 p, %2, 0;\n"
        "  mapa.shared::cluster.u32 remote, %0, %1;\n"
        "  @p mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(smem_addr_u32(local_bar)),
        "r"(cta_rank), "r"(static_cast<u32>(pred))
        : "memory");
}

}  // namespace megamoe_rt::ptx
