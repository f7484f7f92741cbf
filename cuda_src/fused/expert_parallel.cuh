// The fused kernel across expert-parallel ranks: what replaces the one-rank routing, the
// source of a dispatched row, and the cross-rank hand-off before the combine.
//
// Per launch (bank b = launch parity; megamoe_rt/schedule/ep_protocol.py models the protocol):
//   count this rank's pairs per global expert -> grid barrier -> send-list layout (every
//   block scans) -> claims into the send list -> grid barrier -> block d publishes counts
//   and send-list offsets into rank d's bank and releases its count_ready word -> every
//   block waits for all sources and lays out the pool by (local expert, source rank).
// Dispatch warps then pull each row (send-list entry, x row, scales) from its source rank
// and write its metadata; the L2 epilogue scatters into the source's combine buffer.
// After the last tile of every block, block 0 releases combine_ready in every rank's bank
// and every block waits for all ranks' before the combine.
#pragma once

#include "common/types.cuh"
#include "common/warp_scan.cuh"
#include "ep/params.cuh"
#include "fused/params.cuh"
#include "moe/params.cuh"
#include "ptx/ld_st.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::fused {

// Shared-memory scratch after the unit tables, ep_scratch_bytes() of them (generated; the host
// reserves the same): send_offsets[E + 1] | totals[E_local] | src_rows[E_local][R + 1].
struct EpScratch {
    i32* send_offsets;
    i32* totals;
    i32* src_rows;

    __device__ __forceinline__ EpScratch(u32* after_units, u32 num_experts, u32 num_local_experts)
        : send_offsets(reinterpret_cast<i32*>(after_units)),
          totals(send_offsets + num_experts + 1),
          src_rows(totals + num_local_experts) {}
};

// Bytes of EpScratch (0 on one rank): the kernel checks its shared memory against them.
template <bool kEp>
__device__ __forceinline__ u32 ep_scratch_smem_bytes(const FusedParams& p) {
    if constexpr (!kEp) {
        return 0;
    } else {
        return ep_scratch_bytes(p.moe.num_experts, p.moe.num_local_experts, p.num_ranks);
    }
}

__device__ __forceinline__ u32* ep_peer_word(const FusedParams& p, u32 peer, u32 b, u32 index) {
    return reinterpret_cast<u32*>(p.peer_bases[peer] + p.off_ep_banks + 4ull * (b * p.ep_bank.words + index));
}

__device__ __forceinline__ const u32* ep_own_bank(const FusedParams& p, u32 b) {
    return p.ep_banks + b * p.ep_bank.words;
}

// Warp 0: exclusive scan of the per-global-expert send counts into send_offsets[0 .. E].
__device__ __forceinline__ void scan_send_offsets(const u32* counts, u32 num_experts, i32* send_offsets) {
    const u32 lane = threadIdx.x % 32;
    const u32 per = (num_experts + 31) / 32;
    const u32 e0 = min(lane * per, num_experts), e1 = min(e0 + per, num_experts);
    u32 local = 0;
    for (u32 e = e0; e < e1; ++e) local += counts[e];
    const u32 incl = warp_inclusive_sum(local);
    u32 running = incl - local;
    for (u32 e = e0; e < e1; ++e) {
        send_offsets[e] = static_cast<i32>(running);
        running += counts[e];
    }
    if (lane == 31) send_offsets[num_experts] = static_cast<i32>(incl);
}

}  // namespace megamoe_rt::fused
