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
__device__ __forceinline__ void mbarrier_arrive_shared_cluster_remote(u64* local_bar, u32 cta_rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr_u32(local_bar)), "r"(cta_rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

}  // namespace megamoe_rt::ptx
