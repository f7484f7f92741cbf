// The cross-rank steps of the unfused layer under expert parallelism (pull dispatch over
// NVLink, scatter combine), one kernel per step on the caller's stream:
//
//   ep_begin        zero this rank's other bank (launch parity)
//   ep_count        pairs per global expert
//   ep_send_scan    send list layout (grouped by destination rank, then expert)
//   ep_claim        each pair's send-list entry: (weight, token * K + slot)
//   ep_publish      per destination: counts and send-list offsets into its bank, then its
//                   count_ready word (release, system scope)
//   ep_recv_layout  wait for every source's count_ready; lay out the pool by (expert, source)
//   ep_dispatch     pull each pool row from its source rank: the send-list entry, the x row
//                   and its scales, over NVLink; the row's combine slot is in the source's buffer
//   (L1 and L2 grouped GEMMs; the L2 epilogue scatters into the sources' combine buffers, or,
//   with the NVSHMEM transport, into this rank's staging rows)
//   ep_push         NVSHMEM transport only: put each staged partial into its source's combine buffer
//   ep_finish       tell every rank its partials are in, wait until every rank did the same,
//                   record the most pool cycles of any rank, bump the launch epoch
//   (combine over this rank's tokens)
//
// With a ring (pool_rows below the rows laid out) ep_dispatch and the two GEMMs run once per
// cycle, on the window of pool rows [row_base, row_base + pool_rows). A pull reads only what its
// source published before count_ready (x, x_sf, the send list), so cycles need no handshake
// with peers: each rank's host enqueues the same number of cycles (from the layout and the
// call's num_tokens_bound, the same on every rank), and a cycle past a rank's pool is a few
// empty launches.
//
// The kernels that reach other ranks take the transport as a template argument
// (ep/transport.cuh): peer pointers over NVLink, or NVSHMEM's device API.
//
// The protocol and why the parity banks make it safe across back-to-back launches:
// megamoe_rt/schedule/ep_protocol.py (a CPU model) and docs/ARCHITECTURE.md, "Cross-rank
// protocol". Every wait on a peer has a deadline and names the peer.

#include "common/types.cuh"
#include "ep/params.cuh"
#include "ep/pull_row.cuh"
#include "ep/transport.cuh"
#include "moe/params.cuh"
#include "moe/route_count.cuh"
#include "ptx/ld_st.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::ep {

static_assert(kScanThreads >= kMaxExperts, "one scan block covers every global expert (checked on the host)");

__global__ void __launch_bounds__(kThreads) ep_begin(const __grid_constant__ EpParams p) {
    u32* other = p.banks + (launch_bank(p) ^ 1u) * p.bank.words;
    for (u32 i = blockIdx.x * kThreads + threadIdx.x; i < p.bank.words; i += gridDim.x * kThreads) other[i] = 0;
}

template <typename IdxT>
__global__ void __launch_bounds__(kThreads) ep_count(const __grid_constant__ EpParams p) {
    __shared__ i32 hist[kMaxExperts];
    const moe::MoeParams& m = p.moe;
    moe::count_pairs<kThreads>(hist, m.num_experts, m.num_tokens * m.num_topk, p.send_counts,
                               [&m](u32 pair) { return moe::global_expert<IdxT>(m, pair); });
}

// One block: exclusive scan of the send counts (experts are numbered rank-major, so the send
// list comes grouped by destination rank and, inside, by its local expert).
__global__ void __launch_bounds__(kScanThreads) ep_send_scan(const __grid_constant__ EpParams p) {
    __shared__ i32 scan[kScanThreads];
    const u32 e = threadIdx.x;
    const u32 n = p.moe.num_experts;
    const i32 count = e < n ? p.send_counts[e] : 0;
    scan[e] = count;
    moe::block_inclusive_scan<kScanThreads>(scan);
    if (e < n) p.send_offsets[e] = scan[e] - count;
    if (e == n - 1) p.send_offsets[n] = scan[e];
}

template <typename IdxT>
__global__ void __launch_bounds__(kThreads) ep_claim(const __grid_constant__ EpParams p) {
    const moe::MoeParams& m = p.moe;
    const u32 pairs = m.num_tokens * m.num_topk;
    for (u32 i = blockIdx.x * kThreads + threadIdx.x; i < pairs; i += gridDim.x * kThreads) {
        const i32 g = moe::global_expert<IdxT>(m, i);
        if (g < 0) continue;
        const i32 pos = p.send_offsets[g] + atomicAdd(&p.send_cursors[g], 1);
        p.send_list[pos] = (static_cast<u64>(__float_as_uint(m.topk_weights[i])) << 32) | i;
    }
}

// One block. The send list and counts come from earlier kernels on this stream (complete);
// the system-scope release of each count_ready word publishes them to that destination.
template <class Transport>
__global__ void __launch_bounds__(kThreads) ep_publish(const __grid_constant__ EpParams p) {
    const u32 b = launch_bank(p);
    const u32 el = p.moe.num_local_experts;
    for (u32 d = 0; d < p.num_ranks; ++d) {
        for (u32 e = threadIdx.x; e < el; e += kThreads) {
            const u32 slot = p.rank * el + e;
            Transport::store_u32(p, d, bank_word_offset(p, b, p.bank.recv_counts + slot),
                                 static_cast<u32>(p.send_counts[d * el + e]));
            Transport::store_u32(p, d, bank_word_offset(p, b, p.bank.recv_offsets + slot),
                                 static_cast<u32>(p.send_offsets[d * el + e]));
        }
    }
    Transport::complete_own();  // this thread's stores delivered before the barrier
    __syncthreads();
    if (threadIdx.x < p.num_ranks)
        Transport::release_flag(p, threadIdx.x, bank_word_offset(p, b, p.bank.count_ready + p.rank));
}

// One block: wait for every source, then the pool: experts block-aligned, inside an expert
// the sources in rank order.
template <class Transport>
__global__ void __launch_bounds__(kScanThreads) ep_recv_layout(const __grid_constant__ EpParams p) {
    __shared__ i32 scan[kScanThreads];
    const moe::MoeParams& m = p.moe;
    const u32 b = launch_bank(p);
    const u32* bank = p.banks + b * p.bank.words;
    if (threadIdx.x < p.num_ranks)
        sync::wait_ge_acquire_sys_u32(bank + p.bank.count_ready + threadIdx.x, 1, sync::WaitSite::kExpertCountsArrived,
                                      p.wait, threadIdx.x);
    __syncthreads();
    const u32 e = threadIdx.x;
    const u32 el = m.num_local_experts;
    i32 total = 0;
    if (e < el)
        for (u32 s = 0; s < p.num_ranks; ++s) total += static_cast<i32>(bank[p.bank.recv_counts + s * el + e]);
    const i32 align = static_cast<i32>(m.pool_align);
    const i32 padded = (total + align - 1) / align * align;
    scan[e] = padded;
    moe::block_inclusive_scan<kScanThreads>(scan);
    // The routing's checks keep every rank within the worst-case pool; should one still be
    // exceeded, it is reported and leaves every expert empty: the GEMMs then do nothing,
    // rather than scatter rows of a previous launch into peers' combine buffers.
    const bool overflow = static_cast<u32>(scan[kScanThreads - 1]) > m.pool_row_limit;
    if (overflow) total = 0;
    if (e < el) {
        const i32 begin = overflow ? 0 : scan[e] - padded;
        moe::store_expert_range(m, e, begin, total);
        i32 row = begin;
        i32* rows = p.src_rows + e * (p.num_ranks + 1);
        for (u32 s = 0; s < p.num_ranks; ++s) {
            rows[s] = row;
            row += static_cast<i32>(bank[p.bank.recv_counts + s * el + e]);
        }
        rows[p.num_ranks] = row;
    }
    if (e == el - 1) {
        m.expert_offsets[el] = overflow ? 0 : scan[e];
        if (overflow)
            errors::report_error(m.errors, errors::ErrorKind::kPoolOverflow, static_cast<u32>(scan[kScanThreads - 1]),
                                 m.pool_row_limit);
    }
    // This rank's cycles, folded into every rank's bank word; ep_finish reads the word after
    // every rank's combine_ready, which each rank releases after this reduction.
    if (threadIdx.x < p.num_ranks) {
        const u32 cycles = moe::pool_cycles(m, overflow ? 0u : static_cast<u32>(scan[kScanThreads - 1]));
        Transport::max_u32(p, threadIdx.x, bank_word_offset(p, b, p.bank.pool_cycles), cycles);
    }
}

// A warp per pool row of the window [row_base, row_base + pool_rows): find its (expert, source,
// index), pull the send-list entry, the x row and its scales from the source rank into data row
// row - row_base, and write the row's metadata.
template <class Transport>
__global__ void __launch_bounds__(kThreads) ep_dispatch(const __grid_constant__ EpParams p) {
    const moe::MoeParams& m = p.moe;
    const u32 lane = threadIdx.x % 32;
    const u32 warps = gridDim.x * (kThreads / 32);
    const u32 el = m.num_local_experts;
    const u32 rows = static_cast<u32>(m.expert_offsets[el]);  // 0 after an overflow (ep_recv_layout)
    const u32 end = min(rows, m.row_base + m.pool_rows);
    const u32 b = launch_bank(p);
    const u32* bank = p.banks + b * p.bank.words;
    for (u32 row = m.row_base + (blockIdx.x * kThreads + threadIdx.x) / 32; row < end; row += warps) {
        const u32 lo = moe::expert_of_row(m, row);
        const i32* src_rows = p.src_rows + lo * (p.num_ranks + 1);
        if (static_cast<i32>(row) >= src_rows[p.num_ranks]) continue;  // padding
        u32 s = 0;
        while (static_cast<i32>(row) >= src_rows[s + 1]) ++s;
        const u32 list_pos = bank[p.bank.recv_offsets + s * el + lo] + (row - static_cast<u32>(src_rows[s]));
        Transport::pull(p, s, list_pos, row, row - m.row_base, lane);
    }
}

#if defined(MEGAMOE_RT_NVSHMEM_TRANSPORT)
// NVSHMEM transport, after the L2 GEMM of the window [row_base, row_base + pool_rows): a warp
// per laid-out row puts its staged partial into the source rank's combine buffer, then
// completes its puts, so that ep_finish's flags (a later kernel) follow every partial.
__global__ void __launch_bounds__(kThreads) ep_push(const __grid_constant__ EpParams p) {
    const moe::MoeParams& m = p.moe;
    const u32 warps = gridDim.x * (kThreads / 32);
    const u32 el = m.num_local_experts;
    const u32 rows = static_cast<u32>(m.expert_offsets[el]);
    const u32 end = min(rows, m.row_base + m.pool_rows);
    for (u32 row = m.row_base + (blockIdx.x * kThreads + threadIdx.x) / 32; row < end; row += warps) {
        const u32 lo = moe::expert_of_row(m, row);
        if (static_cast<i32>(row) >= p.src_rows[lo * (p.num_ranks + 1) + p.num_ranks]) continue;  // padding
        NvshmemApi::push_partial(p, row, row - m.row_base);
    }
    nvshmem_quiet();
}
#endif

// One block, after the L2 GEMM on this stream has completed: every partial this rank owes
// another rank is in that rank's combine buffer.
static_assert(kMaxRanks <= kThreads, "one thread per rank signals in ep_publish and ep_finish");

template <class Transport>
__global__ void __launch_bounds__(kThreads) ep_finish(const __grid_constant__ EpParams p) {
    const u32 b = launch_bank(p);
    if (threadIdx.x < p.num_ranks) {
        Transport::release_flag(p, threadIdx.x, bank_word_offset(p, b, p.bank.combine_ready + p.rank));
        const u32* own = p.banks + b * p.bank.words;
        sync::wait_ge_acquire_sys_u32(own + p.bank.combine_ready + threadIdx.x, 1, sync::WaitSite::kCombineArrived,
                                      p.wait, threadIdx.x);
    }
    __syncthreads();
    // Every read of the epoch in this launch is behind us (earlier kernels, and the bank above).
    if (threadIdx.x == 0) {
        *p.moe.pool_cycles = ptx::ld_acquire_sys_u32(p.banks + b * p.bank.words + p.bank.pool_cycles);
        *p.launch_epoch += 1;
    }
}

}  // namespace megamoe_rt::ep
