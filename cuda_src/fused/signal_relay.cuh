// Publishing a tile's completion to other blocks without stalling the math warpgroups.
//
// A GPU-scope release (and the proxy fence published TMA inputs need) waits for the
// releasing thread's earlier writes to be performed. Done by a math thread, it holds up its
// whole warpgroup (wgmma is warpgroup-collective) once per tile. Instead the math leader
// posts the counter to bump into a small shared-memory queue (release at CTA scope) and a
// relay thread of the producer warpgroup does the fence and the release. Cumulativity
// carries the math threads' stores: they precede the leader's post through a named
// barrier, and the relay acquires the post before releasing at GPU scope.
#pragma once

#include "common/types.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/ld_st_shared.cuh"

namespace megamoe_rt::fused {

struct SignalRelay {
    static constexpr u32 kDepth = 32;
    static constexpr u32 kWords = kDepth + 2;
    static constexpr u32 kProxyFence = 1u << 31;   // the counter publishes rows TMA will read
    static constexpr u32 kStop = 0xFFFFFFFFu;

    u32* head;      // posts so far (written by the math leader)
    u32* tail;      // posts relayed (written by the relay)
    u32* entries;   // [kDepth]: word offset of the counter in the bank, | kProxyFence

    __device__ __forceinline__ explicit SignalRelay(u32* words) : head(words), tail(words + 1), entries(words + 2) {}

    // Math leader. `posted` is its own count of posts (it is the only writer of head).
    __device__ __forceinline__ void post(u32& posted, u32 entry) const {
        while (posted - ptx::ld_acquire_cta_shared_u32(tail) >= kDepth) {
        }
        entries[posted % kDepth] = entry;
        ptx::st_release_cta_shared_u32(head, ++posted);
    }

    // Relay thread: until the stop entry, bump each posted counter with a GPU-scope release.
    __device__ __forceinline__ void run(u32* bank) const {
        u32 done = 0;
        for (;;) {
            const u32 posted = ptx::ld_acquire_cta_shared_u32(head);
            for (; done < posted; ++done) {
                const u32 e = entries[done % kDepth];
                if (e == kStop) return;
                if (e & kProxyFence) ptx::fence_proxy_async_global();
                ptx::red_release_gpu_add_u32(bank + (e & ~kProxyFence), 1);
                ptx::st_release_cta_shared_u32(tail, done + 1);
            }
        }
    }
};

}  // namespace megamoe_rt::fused
