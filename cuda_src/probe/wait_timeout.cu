// Test kernel: waits for a signal word to reach `expected` with a deadline. With the
// signal withheld it must trap with a message naming the wait instead of hanging.

#include "common/types.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::probe {

__global__ void wait_for_signal(const u64* word, u64 expected, u64 timeout_ns, u32 rank, u32 peer, u64* seen_out,
                                sync::TimeoutRecord* record) {
    if (threadIdx.x != 0) return;
    const sync::WaitContext ctx{timeout_ns, record, rank, 0};
    *seen_out = sync::wait_ge_acquire_sys_u64(word, expected, sync::WaitSite::kTest, ctx, peer);
}

}  // namespace megamoe_rt::probe
