// Test kernels: a wait for a signal word to reach `expected`, and an mbarrier wait, each with
// a deadline. With the signal or the arrival withheld they must trap with a message naming
// the wait instead of hanging, and print it once however many blocks time out.

#include "common/types.cuh"
#include "ptx/mbarrier.cuh"
#include "sync/deadline_wait.cuh"
#include "sync/mbarrier_deadline.cuh"

namespace megamoe_rt::probe {

__global__ void wait_for_signal(const u64* word, u64 expected, u64 timeout_ns, u32 rank, u32 peer, u64* seen_out,
                                sync::TimeoutRecord* record) {
    if (threadIdx.x != 0) return;
    const sync::WaitContext ctx{timeout_ns, record, rank, 0};
    *seen_out = sync::wait_ge_acquire_sys_u64(word, expected, sync::WaitSite::kTest, ctx, peer);
}

// Every thread waits on phase 0 of a block-local mbarrier that thread 0 completes only when
// `arrive` is set. The context comes as a parameter, as the layer's kernels get theirs.
__global__ void wait_for_mbarrier(const __grid_constant__ sync::WaitContext ctx, u32 arrive, u32 peer) {
    __shared__ u64 bar;
    if (threadIdx.x == 0) ptx::mbarrier_init_shared(&bar, 1);
    __syncthreads();
    if (arrive != 0 && threadIdx.x == 0) ptx::mbarrier_arrive_shared(&bar);
    sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kSmemStageFull>(&bar, 0, {ctx, 0}, peer);
}

}  // namespace megamoe_rt::probe
