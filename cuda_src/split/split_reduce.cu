// Split pipeline K3: the top-k reduce, y[t] = bf16(sum over valid slots, in slot order, of
// fp32(partial[k][t])), once K1 and K2 are done (the graph's edges order it after both).
//
// It runs in its own SM partition (SplitSms.reduce) with many small blocks, since the reduce is
// bound by the bandwidth of reading K partials per token. Across ranks it first waits until
// every rank has scattered its partials into this rank's combine buffer. The last block out
// advances the launch epoch, which K1, K2 and this kernel have all read by then (its parity
// picks the EP bank peers write for the next call).

#include "common/types.cuh"
#include "fused/expert_parallel.cuh"
#include "fused/params.cuh"
#include "moe/combine_token.cuh"
#include "moe/params.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/special_regs.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::split {

using fused::FusedParams;
using fused::kReduceThreads;

constexpr u32 kTokenThreads = 128;  // threads that reduce one token (the fused kernel's tail uses as many)

template <typename IdxT, bool kEp>
__global__ void __launch_bounds__(kReduceThreads) split_reduce(const __grid_constant__ FusedParams p) {
    static_assert(kReduceThreads % kTokenThreads == 0, "whole token groups per block");
    constexpr u32 kGroups = kReduceThreads / kTokenThreads;
    const moe::MoeParams& m = p.moe;
    // Profiling only: this block's row of the trace (start, finish, SM).
    u64* trace = p.trace == nullptr ? nullptr : p.trace + static_cast<u64>(blockIdx.x) * fused::kTraceEvents;
    __shared__ u32 epoch;
    if (threadIdx.x == 0) {
        if (trace != nullptr) {
            trace[fused::kTraceStart] = ptx::globaltimer_ns();
            trace[fused::kTraceSm] = ptx::smid();
        }
        epoch = ptx::ld_relaxed_gpu_u32(p.launch_epoch);
    }
    __syncthreads();
    const u32 b = epoch & 1;
    u32* bank = p.banks[b];
    // K1 has finished (graph edge): a plain load sees its word.
    const bool overflow = (bank[p.bank.routing_published] & 2u) != 0;
    if constexpr (kEp) {
        // One thread per source rank, so no trap sits inside a loop.
        if (threadIdx.x < p.num_ranks)
            sync::wait_ge_acquire_sys_u32_quiet(fused::ep_own_bank(p, b) + p.ep_bank.combine_ready + threadIdx.x, 1,
                                                sync::WaitSite::kCombineArrived, p.wait, threadIdx.x,
                                                sync::kPeerStallShift);
        __syncthreads();
    }
    const u32 group = threadIdx.x / kTokenThreads;
    for (u32 token = blockIdx.x * kGroups + group; token < m.num_tokens; token += gridDim.x * kGroups) {
        const u32 mask = overflow ? 0u : moe::valid_slot_mask<IdxT>(m, token);
        moe::combine_token(m, token, mask, threadIdx.x % kTokenThreads, kTokenThreads);
    }
    __syncthreads();  // the block's tokens are reduced before its finish stamp
    if (threadIdx.x == 0) {
        if (trace != nullptr) trace[fused::kTraceCombineDone] = ptx::globaltimer_ns();
        const u32 exits = atomicAdd(bank + p.bank.reduce_exits, 1u) + 1;
        if (exits == gridDim.x) ptx::st_relaxed_gpu_u32(p.launch_epoch, epoch + 1);
    }
}

}  // namespace megamoe_rt::split
