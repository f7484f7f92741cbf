// Device helpers over the parameters of the expert-parallel (multi-rank) kernels of the
// unfused layer. EpParams, EpBankLayout and the limits are declared in
// megamoe_rt/kernels/interface/ep.py (generated into interface/ep.cuh). Regions of the
// symmetric buffer sit at the same offsets on every rank, so a peer's region is
// peer_bases[peer] + its offset.
#pragma once

#include "common/types.cuh"
#include "interface/ep.cuh"
#include "moe/params.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::ep {

__device__ __forceinline__ u32 launch_bank(const EpParams& p) { return *p.launch_epoch & 1u; }

template <typename T>
__device__ __forceinline__ T* peer_ptr(const EpParams& p, u32 peer, u64 offset) {
    return reinterpret_cast<T*>(p.peer_bases[peer] + offset);
}

// Byte offset of word `index` of bank b in the buffer (the same on every rank).
__device__ __forceinline__ u64 bank_word_offset(const EpParams& p, u32 b, u32 index) {
    return p.off_banks + 4ull * (b * p.bank.words + index);
}

}  // namespace megamoe_rt::ep
