// How the expert-parallel kernels of the unfused layer reach other ranks: the cross-rank
// operations they make, by transport. Each is a policy type the kernels take as a template
// argument; both give the same results, bit for bit.
//
//   PeerPointers  loads and stores through the peers' mappings of the symmetric buffer (NVLink
//                 or PCIe P2P, one node): EpParams::peer_bases[peer] + a region's offset.
//   NvshmemApi    NVSHMEM's device API (any transport NVSHMEM has: InfiniBand, IBGDA, or
//                 NVLink where a peer is mapped): puts, gets and atomics on symmetric
//                 addresses, which are this rank's own buffer base + the same offset. Kernels
//                 instantiated with it link NVSHMEM's device library (megamoe_rt/jit/link.py).
//
// The operations:
//   store_u32(peer, offset, v)   a word into the peer's buffer, unordered
//   complete_own()               this thread's stores and puts delivered (before a barrier)
//   release_flag(peer, offset)   1 into a flag word, ordered after every earlier store or put of
//                                this thread to that peer and after the block's (the caller
//                                synchronises the block first)
//   max_u32(peer, offset, v)     the peer's word = max(word, v), relaxed
//   pull_row(...)                a routed row, its scales and its send-list entry from the
//                                source rank into this rank's pool (ep/pull_row.cuh)
//   kDirectCombine               whether the L2 epilogue may store partial rows straight into
//                                the source rank's combine buffer (PeerPointers), or writes a
//                                local staging row that push_partial then puts (NvshmemApi)
#pragma once

#include "common/types.cuh"
#include "ep/params.cuh"
#include "ep/pull_row.cuh"
#include "ptx/ld_st.cuh"

#if defined(MEGAMOE_RT_NVSHMEM_TRANSPORT)
#include "common/nvshmem_device_api.cuh"
#endif

namespace megamoe_rt::ep {

struct PeerPointers {
    static constexpr bool kDirectCombine = true;

    // Stores through the mappings need no completion step of their own: the release below
    // orders them (the fence covers the block's stores, observed through its barrier).
    __device__ __forceinline__ static void complete_own() {}
    __device__ __forceinline__ static void store_u32(const EpParams& p, u32 peer, u64 offset, u32 v) {
        *peer_ptr<u32>(p, peer, offset) = v;
    }
    __device__ __forceinline__ static void release_flag(const EpParams& p, u32 peer, u64 offset) {
        ptx::fence_acq_rel_sys();  // the block's stores, observed through its barrier, before the flag
        ptx::st_release_sys_u32(peer_ptr<u32>(p, peer, offset), 1);
    }
    __device__ __forceinline__ static void max_u32(const EpParams& p, u32 peer, u64 offset, u32 v) {
        ptx::red_relaxed_sys_max_u32(peer_ptr<u32>(p, peer, offset), v);
    }
    __device__ __forceinline__ static void pull(const EpParams& p, u32 source, u32 list_pos, u32 row, u32 data_row,
                                                u32 lane) {
        const SourceRegions regions{p.peer_bases[source], p.off_x, p.off_x_sf, p.off_send_list, p.off_combine};
        pull_row(p.moe, regions, source, list_pos, row, data_row, lane);
    }
};

#if defined(MEGAMOE_RT_NVSHMEM_TRANSPORT)

struct NvshmemApi {
    static constexpr bool kDirectCombine = false;

    // Every put and atomic this thread has issued delivered, before the block's barrier.
    __device__ __forceinline__ static void complete_own() { nvshmem_quiet(); }
    // The symmetric address of a region's byte `offset`: this rank's own copy.
    template <typename T>
    __device__ __forceinline__ static T* symmetric(const EpParams& p, u64 offset) {
        return reinterpret_cast<T*>(p.peer_bases[p.rank] + offset);
    }
    __device__ __forceinline__ static void store_u32(const EpParams& p, u32 peer, u64 offset, u32 v) {
        nvshmem_uint32_p(symmetric<u32>(p, offset), v, static_cast<int>(peer));
    }
    __device__ __forceinline__ static void release_flag(const EpParams& p, u32 peer, u64 offset) {
        // Every thread of the block completed its own puts before the barrier (complete_own),
        // or an earlier kernel did (ep_push); the fence orders this thread's own as well.
        nvshmem_fence();
        nvshmem_uint32_atomic_set(symmetric<u32>(p, offset), 1, static_cast<int>(peer));
    }
    __device__ __forceinline__ static void max_u32(const EpParams& p, u32 peer, u64 offset, u32 v) {
        u32* word = symmetric<u32>(p, offset);
        u32 seen = nvshmem_uint32_atomic_fetch(word, static_cast<int>(peer));
        while (seen < v) {
            const u32 before = nvshmem_uint32_atomic_compare_swap(word, seen, v, static_cast<int>(peer));
            if (before == seen) break;
            seen = before;
        }
    }
    // Warp-wide: as pull_row, through gets; the row's partial comes back through this rank's
    // staging row `data_row` (kDirectCombine is false), which push_partial puts to the source.
    __device__ __forceinline__ static void pull(const EpParams& p, u32 source, u32 list_pos, u32 row, u32 data_row,
                                                u32 lane) {
        const moe::MoeParams& m = p.moe;
        const int pe = static_cast<int>(source);
        const u64 entry = nvshmem_uint64_g(symmetric<u64>(p, p.off_send_list) + list_pos, pe);
        const u32 pair = static_cast<u32>(entry);
        const u32 token = pair / m.num_topk, slot = pair % m.num_topk;
        nvshmemx_getmem_warp(m.pool + static_cast<u64>(data_row) * m.hidden,
                             symmetric<u8>(p, p.off_x) + static_cast<u64>(token) * m.hidden, m.hidden, pe);
        const u32 sf_cols = m.hidden / 128;
        const float* src_sf = symmetric<float>(p, p.off_x_sf) + static_cast<u64>(token) * sf_cols;
        for (u32 c = lane; c < sf_cols; c += 32)
            m.pool_sf[static_cast<u64>(c) * m.pool_rows + data_row] = nvshmem_float_g(src_sf + c, pe);
        if (lane == 0) {
            m.pool_src[row] = static_cast<i32>((source * m.token_capacity + token) * m.num_topk + slot);
            m.pool_weight[row] = __uint_as_float(static_cast<u32>(entry >> 32));
            m.pool_dst[row] = p.staging + static_cast<u64>(data_row) * m.hidden * 2ull;
        }
    }
    // Warp-wide: pool row `row`'s partial (staging row `data_row`) into its source rank's
    // combine buffer, at the token's slot.
    __device__ __forceinline__ static void push_partial(const EpParams& p, u32 row, u32 data_row) {
        const moe::MoeParams& m = p.moe;
        const u32 src = static_cast<u32>(m.pool_src[row]);
        const u32 slot = src % m.num_topk, token = (src / m.num_topk) % m.token_capacity;
        const u32 source = src / m.num_topk / m.token_capacity;
        const u64 bytes = m.hidden * 2ull;
        u8* dst = symmetric<u8>(p, p.off_combine) + (static_cast<u64>(slot) * m.token_capacity + token) * bytes;
        nvshmemx_putmem_nbi_warp(dst, reinterpret_cast<const u8*>(p.staging) + data_row * bytes, bytes,
                                 static_cast<int>(source));
    }
};

#endif

}  // namespace megamoe_rt::ep
