// Parameters of the expert-parallel (multi-rank) kernels of the unfused layer. Host mirror:
// megamoe_rt.kernels.ep.EpParams. Regions of the symmetric buffer sit at the same offsets on
// every rank, so a peer's region is peer_bases[peer] + its offset.
#pragma once

#include "common/types.cuh"
#include "moe/params.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::ep {

// Words peers write into this rank's buffer, in one of two banks picked by the launch parity
// (the launch zeroes the other bank for the next one; megamoe_rt/ep_protocol.py models why
// that is safe). Word offsets inside a bank:
struct EpBankLayout {
    u32 words;
    u32 recv_counts;     // [num_ranks][num_local_experts] rows source s sends to local expert e
    u32 recv_offsets;    // [num_ranks][num_local_experts] where they start in s's send list
    u32 count_ready;     // [num_ranks] source s has published its counts and send list
    u32 combine_ready;   // [num_ranks] rank s has scattered every partial it owes this rank
    u32 pad_;
};

struct EpParams {
    moe::MoeParams moe;          // this rank's tokens and routing, pool, combine buffer, y;
                                 // expert_counts = received rows per local expert (all sources)
    const u64* peer_bases;       // [num_ranks] base address of every rank's buffer (own included)
    u64 off_x;                   // byte offsets of regions, the same on every rank
    u64 off_x_sf;
    u64 off_send_list;
    u64 off_combine;
    u64 off_banks;
    i32* send_counts;            // [num_experts] this rank's pairs per global expert
    i32* send_offsets;           // [num_experts + 1] exclusive scan: send list grouped by expert
    i32* send_cursors;           // [num_experts]
    u64* send_list;              // [num_tokens * num_topk] (weight bits << 32) | (token * num_topk + slot)
    i32* src_rows;               // [num_local_experts][num_ranks + 1] first pool row per source; last = end
    u32* banks;                  // this rank's banks (bank b at banks + b * bank.words)
    EpBankLayout bank;
    u32* launch_epoch;
    sync::WaitContext wait;
    u32 rank;
    u32 num_ranks;
};

__device__ __forceinline__ u32 launch_bank(const EpParams& p) { return *p.launch_epoch & 1u; }

template <typename T>
__device__ __forceinline__ T* peer_ptr(const EpParams& p, u32 peer, u64 offset) {
    return reinterpret_cast<T*>(p.peer_bases[peer] + offset);
}

// A word of bank b in rank `peer`'s buffer.
__device__ __forceinline__ u32* peer_bank_word(const EpParams& p, u32 peer, u32 b, u32 index) {
    return peer_ptr<u32>(p, peer, p.off_banks + 4ull * (b * p.bank.words + index));
}

}  // namespace megamoe_rt::ep
