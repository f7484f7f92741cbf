// Publishing a tile's completion to other blocks without stalling the math warpgroups.
//
// A GPU-scope release (and the proxy fence published TMA inputs need) waits for the
// releasing thread's earlier writes to be performed. Done by a math thread, it holds up its
// whole warpgroup (wgmma is warpgroup-collective) once per tile. Instead the math leader
// posts the counter to bump into a small shared-memory ring on mbarriers (arrive releases,
// wait acquires, at CTA scope) and a relay thread of the producer warpgroup does the fence
// and the release. Cumulativity carries the math threads' stores: they precede the leader's
// post through a named barrier, and the relay acquires the post before releasing at GPU
// scope. The relay sleeps in mbarrier waits instead of polling, so it takes no issue slots
// from the math warps of its SM.
#pragma once

#include "common/types.cuh"
#include "interface/fused.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/mbarrier.cuh"
#include "sync/mbarrier_deadline.cuh"

namespace megamoe_rt::fused {

struct SignalRelay {
    static constexpr u32 kDepth = 16;
    static constexpr u32 kBytes = kDepth * (8 + 8 + 4);
    static_assert(kBytes == kRelayBytes, "the host reserves kRelayBytes (interface/fused.cuh) for the relay");
    static constexpr u32 kProxyFence = 1u << 31;  // the counter publishes rows TMA will read
    static constexpr u32 kStop = 0xFFFFFFFFu;

    u64* full;     // [kDepth] the leader's post is in
    u64* empty;    // [kDepth] the relay is done with it
    u32* entries;  // [kDepth]: word offset of the counter in the bank, | kProxyFence

    __device__ __forceinline__ explicit SignalRelay(u8* base)
        : full(reinterpret_cast<u64*>(base)), empty(full + kDepth), entries(reinterpret_cast<u32*>(empty + kDepth)) {}

    __device__ __forceinline__ void init() const {
        for (u32 i = 0; i < kDepth; ++i) {
            ptx::mbarrier_init_shared(full + i, 1);
            ptx::mbarrier_init_shared(empty + i, 1);
        }
    }

    // Math leader. `posted` is its own count of posts. The wait for a free slot has no deadline
    // check of its own (it sits in the math warpgroups' registers): the relay thread blocks on
    // nothing but posts, so a slot it has not freed yet is freed as soon as it runs.
    __device__ __forceinline__ void post(u32& posted, u32 entry) const {
        const u32 slot = posted % kDepth, phase = (posted / kDepth) & 1;
        ptx::mbarrier_wait_parity_shared_bounded_elsewhere(empty + slot, phase ^ 1);  // the first pass finds it free
        entries[slot] = entry;
        ptx::mbarrier_arrive_shared(full + slot);
        ++posted;
    }

    // Relay thread: until the stop entry, bump each posted counter with a GPU-scope release.
    // Its waits span the whole of the block's tile work: the relay sleeps until a post comes.
    __device__ __forceinline__ void run(u32* bank, const sync::MbarrierDeadline& deadline) const {
        for (u32 done = 0;; ++done) {
            const u32 slot = done % kDepth, phase = (done / kDepth) & 1;
            sync::mbarrier_wait_parity_shared_or_trap<sync::WaitSite::kRelayPost>(full + slot, phase, deadline, slot);
            const u32 e = entries[slot];
            ptx::mbarrier_arrive_shared(empty + slot);
            if (e == kStop) return;
            if (e & kProxyFence) ptx::fence_proxy_async_global();
            ptx::red_release_gpu_add_u32(bank + (e & ~kProxyFence), 1);
        }
    }
};

}  // namespace megamoe_rt::fused
