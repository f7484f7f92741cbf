// The fused MoE layer for sm_90a: one persistent, cooperative launch runs
//   route count -> pool layout -> row claims -> dispatch | L1 GEMM + SwiGLU + requant | L2 GEMM + scatter
//   -> combine
// with the GEMM tiles of both layers in one lag task order (fused/task_order.cuh).
//
// Roles after the two grid barriers of the routing phase:
//   warpgroup 0, warp 0    TMA producer for both GEMMs; it also does every wait on another
//                          block's progress, before loading a tile, so the math warpgroups
//                          never wait on anything but their own pipeline
//   warpgroup 0, warps 1-2 dispatch: copy routed rows into the pool in pool order, publish
//                          per-block arrival counts
//   warpgroup 0, warp 3    relay: publishes the math warpgroups' tile completions to other
//                          blocks (fused/signal_relay.cuh)
//   warpgroups 1-2         wgmma math (a 64 x 256 tile, N split), epilogues, then the combine
//
// The pool and the L1 output (activation) pool are rings of `ring_blocks` slots of BLOCK_M
// rows; block b lives in slot b % ring_blocks. Dispatch refills a slot once the L1 tiles of
// its previous block are published; an L1 tile overwrites an activation slot once the L2
// tiles of its previous block have read it. Per-row metadata (source pair, top-k weight,
// combine address) stays full size, indexed by the global pool row.
//
// The split pipeline launches the same kernel twice, concurrently, in disjoint SM partitions
// (Role, interface/fused.cuh): K1 (kSplitL1) routes, dispatches and runs the L1 tiles; K2
// (kSplitL2) waits for K1's routing, builds the same tables and runs the L2 tiles, each
// waiting on its block's published L1 output. Neither combines: K3 (split/split_reduce.cu)
// does, after both. The graph's memset node zeroes the counter banks before every replay.
//
// A streamed call (kStreamed) has no routing phase: the dispatch warps consume the input ring
// and the tiles follow pool blocks as they complete (fused/streamed_call.cuh).

#include "common/types.cuh"
#include "ep/pull_row.cuh"
#include "fused/expert_parallel.cuh"
#include "fused/params.cuh"
#include "fused/signal_relay.cuh"
#include "fused/streamed_call.cuh"
#include "fused/task_order.cuh"
#include "fused/tile_queue.cuh"
#include "fused/trace.cuh"
#include "fused/unit_table.cuh"
#include "gemm/config.cuh"
#include "gemm/epilogue_scatter_bf16.cuh"
#include "gemm/epilogue_swiglu_fp8.cuh"
#include "gemm/mainloop.cuh"
#include "moe/combine_token.cuh"
#include "moe/params.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/special_regs.cuh"
#include "ptx/sync.cuh"
#include "ptx/tma.cuh"
#include "ptx/warp_uniform.cuh"
#include "sync/deadline_wait.cuh"
#include "sync/grid_barrier.cuh"
#include "sync/named_barriers.cuh"

namespace megamoe_rt::fused {

// kBlockM, kBlockN and kNumThreads come from interface/fused.cuh (the host sizes by them too).
constexpr u32 kNumDispatchWarps = 2;
// Loads in flight per lane while a streamed call's dispatch copies a row: the dispatch warps
// share the producer warpgroup's 80 registers (kSplitProducerRegs; ptxas spilled at four with
// NVRTC 13.0).
constexpr u32 kStreamedCopyBatch = 3;
constexpr u32 kRelayThread = 96;
using sync::kPartialsBarrier;
constexpr u32 kProducerRegs = 72;
// Split K1 across ranks pulls rows with the tables' base live through the dispatch loop: 72
// registers spilled it. 128 x 80 + 256 x 208 still fits the register file.
constexpr u32 kSplitProducerRegs = 80;
constexpr u32 kMathRegs = 208;
static_assert(128 * kSplitProducerRegs + 256 * kMathRegs <= 65536, "the register file of one block per SM");
using sync::kMathBarrier;

template <u32 kStages, u32 kActSfGran>
using L1Config = gemm::Config<kBlockM, kBlockN, kStages, 128, 64, kActSfGran, 1, gemm::GroupLayout::kContiguous,
                              gemm::SwigluFp8Epilogue>;
template <u32 kStages, u32 kActSfGran>
using L2Config = gemm::Config<kBlockM, kBlockN, kStages, kActSfGran, 128, 128, 1, gemm::GroupLayout::kContiguous,
                              gemm::ScatterBf16Epilogue>;

// Routing tables every block builds in shared memory after the counts are known.
struct RoutingTables {
    i32* row_begin;   // [num_local_experts + 1] first pool row of each expert; last = total rows
    i32* row_end;     // [num_local_experts] end of its routed rows (the rest up to the next begin is padding)
    u32* unit_begin;  // [num_local_experts + 1] first unit of each expert; last = total units
    u32* scalars;     // [0] units, [1] blocks, [2] pool overflow, [3] launch epoch
    TileQueue tiles;  // first in the region: mbarriers need 8-byte alignment
    SignalRelay relay;

    __device__ __forceinline__ RoutingTables(u8* base, u32 num_local_experts)
        : tiles(base), relay(base + TileQueue::kBytes) {
        // The scalars first: at a fixed offset from the base their address costs no register
        // of its own across the kernel (after row_end it depends on the expert count, and
        // older ptxas versions spilled it).
        scalars = reinterpret_cast<u32*>(base + TileQueue::kBytes + SignalRelay::kBytes);
        row_begin = reinterpret_cast<i32*>(scalars + 4);
        row_end = row_begin + num_local_experts + 1;
        unit_begin = reinterpret_cast<u32*>(row_end + num_local_experts);
    }
    // The layout above occupies routing_table_bytes() (generated; the host reserves the same).
    static __device__ __forceinline__ u32 bytes(u32 num_local_experts) {
        return routing_table_bytes(num_local_experts);
    }
    // Shared memory past the tables (EpScratch across ranks).
    __device__ __forceinline__ u32* end(u32 num_local_experts) const { return unit_begin + num_local_experts + 1; }
    // This launch's counter bank. The epoch lives in shared memory rather than in a register
    // kept across the roles' register reallocation.
    __device__ __forceinline__ u32* bank(const FusedParams& p) const { return p.banks[scalars[3] & 1]; }
    // Read from shared memory wherever needed, for the same reason.
    __device__ __forceinline__ bool overflow() const { return scalars[2] != 0; }
    __device__ __forceinline__ UnitTable units(u32 num_local_experts) const {
        return UnitTable{row_begin, unit_begin, num_local_experts, scalars[0], kBlockM};
    }
    // Routed rows of pool block b (0 for a block of padding only, which cannot exist).
    __device__ __forceinline__ u32 block_rows(u32 expert, u32 block) const {
        return static_cast<u32>(min(static_cast<i32>(kBlockM), row_end[expert] - static_cast<i32>(block * kBlockM)));
    }
};

// Warp 0: the pool layout and unit table (fused/unit_table.cuh) into this block's tables.
// Pool rows are i32 there: the host keeps the worst-case block count within kMaxBlocks.
static_assert(static_cast<u64>(kMaxBlocks) * kBlockM < (1ull << 31), "pool rows fit an i32");
__device__ __forceinline__ void build_tables(const FusedParams& p, const u32* counts, const RoutingTables& tab) {
    build_unit_table<kBlockM>(counts, p.moe.num_local_experts, p.max_blocks, tab.row_begin, tab.row_end, tab.unit_begin,
                              tab.scalars);
}

// Split K1, thread 0 of block 0 once the pool is laid out and claimed: K2 may build its tables
// (the overflow bit also tells K3 to write zeros).
__device__ __forceinline__ void publish_routing(const FusedParams& p, const RoutingTables& tab) {
    ptx::st_release_gpu_u32(tab.bank(p) + p.bank.routing_published, 1u | (tab.overflow() ? 2u : 0u));
}

// Across ranks: pool row `row` of `expert` comes from the source rank whose range holds it
// (sources in rank order); its send-list entry, x row and scales are pulled over NVLink and
// its metadata written here (one rank claims rows in the routing phase instead).
__device__ __forceinline__ void pull_row_from_source(const FusedParams& p, const RoutingTables& tab, u32 expert,
                                                     u32 row, u32 slot_row, u32 lane) {
    const moe::MoeParams& m = p.moe;
    const EpScratch ep(tab.end(m.num_local_experts), m.num_experts, m.num_local_experts);
    const i32* src_rows = ep.src_rows + expert * (p.num_ranks + 1);
    u32 s = 0;
    while (static_cast<i32>(row) >= src_rows[s + 1]) ++s;
    const u32* own = ep_own_bank(p, tab.scalars[3] & 1);
    const u32 pos =
        own[p.ep_bank.recv_offsets + s * m.num_local_experts + expert] + (row - static_cast<u32>(src_rows[s]));
    const ep::SourceRegions regions{p.peer_bases[s], p.off_x, p.off_x_sf, p.off_send_list, p.off_combine};
    ep::pull_row(m, regions, s, pos, row, slot_row, lane);
}

// Dispatch warps: rows in pool order, warps interleaved across blocks, so pool blocks (and
// with them L1 tiles, which the order also takes in pool order) complete front to back.
template <bool kEp, Role kRole>
__device__ __forceinline__ void dispatch_rows(const FusedParams& p, const RoutingTables& tab) {
    const moe::MoeParams& m = p.moe;
    u32* bank = tab.bank(p);
    const u32 lane = threadIdx.x % 32;
    const u32 warp = threadIdx.x / 32 - 1;
    const u32 num_warps = ptx::nctaid_x() * kNumDispatchWarps;
    const u32 total_rows = static_cast<u32>(tab.row_begin[m.num_local_experts]);
    const u32 sf_cols = m.hidden / 128;
    const u32 l1_tiles = p.l1.n / kBlockN;
    u32 expert = 0;
    for (u32 row = warp * ptx::nctaid_x() + ptx::ctaid_x(); row < total_rows; row += num_warps) {
        while (static_cast<i32>(row) >= tab.row_begin[expert + 1]) ++expert;
        if (static_cast<i32>(row) >= tab.row_end[expert]) continue;  // padding
        const u32 block = row / kBlockM;
        if (block >= p.ring_blocks) {
            // The slot's previous block must be through its L1 tiles before its rows are replaced.
            if (lane == 0) {
                const TracedWait timed(p, kTraceWaitDispatchNs);
                sync::wait_ge_acquire_gpu_u32(bank + p.bank.l1_done + block - p.ring_blocks, l1_tiles,
                                              sync::WaitSite::kPoolSlotFree, p.wait, block, sync::kDerivedWaitShift);
            }
            __syncwarp();
        }
        const u32 slot_row = (block % p.ring_blocks) * kBlockM + row % kBlockM;
        if constexpr (kEp) {
            pull_row_from_source(p, tab, expert, row, slot_row, lane);
        } else {
            const u32 token = static_cast<u32>(m.pool_src[row]) / m.num_topk;
            const ptx::u32x4* src = reinterpret_cast<const ptx::u32x4*>(m.x + static_cast<u64>(token) * m.hidden);
            ptx::u32x4* dst = reinterpret_cast<ptx::u32x4*>(m.pool + static_cast<u64>(slot_row) * m.hidden);
#pragma unroll 4
            for (u32 v = lane; v < m.hidden / 16; v += 32) dst[v] = ptx::ld_global_nc_v4_u32(src + v);
            for (u32 j = lane; j < sf_cols; j += 32)
                m.pool_sf[static_cast<u64>(j) * m.pool_rows + slot_row] = m.x_sf[static_cast<u64>(token) * sf_cols + j];
        }
        // The rows are read by TMA (the async proxy) in another block.
        ptx::fence_proxy_async_global();
        __syncwarp();
        const bool withheld = kRole == Role::kFused && block == p.withhold_block;
        if (lane == 0 && !withheld) ptx::red_release_gpu_add_u32(bank + p.bank.arrivals + block, 1);
    }
}

// Routing, by every thread of every block: count the pairs of each local expert, build the
// tables (every block its own copy), claim a pool row per pair and write its metadata.
// A routing that overflows the worst-case pool is flagged and the call skipped (zeros out).
template <class IdxT, Role kRole>
__device__ __forceinline__ void route_and_claim(const FusedParams& p, const RoutingTables& tab) {
    const moe::MoeParams& m = p.moe;
    u32* bank = tab.bank(p);
    u32* next_bank = p.banks[(tab.scalars[3] & 1) ^ 1];
    const u32 grid_threads = gridDim.x * kNumThreads;
    const u32 gtid = blockIdx.x * kNumThreads + threadIdx.x;
    if constexpr (kRole == Role::kFused)  // the split graph's memset node zeroes the banks
        for (u32 i = gtid; i < p.bank.words; i += grid_threads) next_bank[i] = 0;

    const u32 pairs = m.num_tokens * m.num_topk;
    i32* hist = tab.row_end;  // scratch until the tables are built
    for (u32 i = gtid; i < pairs; i += grid_threads) {
        const i32 e = moe::local_expert<IdxT>(m, i);
        if (e >= 0) atomicAdd(&hist[e], 1);
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < m.num_local_experts; e += kNumThreads)
        if (hist[e]) atomicAdd(bank + p.bank.counts + e, static_cast<u32>(hist[e]));
    __syncthreads();
    if (threadIdx.x == 0) {
        sync::grid_barrier_acq_rel_gpu(p.grid_barrier, gridDim.x, p.wait);
        trace(p, kTraceCounted);
    }
    __syncthreads();

    if (threadIdx.x < 32) build_tables(p, bank + p.bank.counts, tab);
    __syncthreads();
    const bool overflow = tab.scalars[2] != 0;
    if (blockIdx.x == 0) {
        for (u32 e = threadIdx.x; e <= m.num_local_experts; e += kNumThreads) {
            m.expert_offsets[e] = tab.row_begin[e];
            if (e < m.num_local_experts && m.expert_recv_stats != nullptr)
                m.expert_recv_stats[e] += static_cast<i32>(bank[p.bank.counts + e]);
        }
        if (threadIdx.x == 0 && overflow)
            errors::report_error(m.errors, errors::ErrorKind::kPoolOverflow, tab.scalars[1] * kBlockM,
                                 p.max_blocks * kBlockM);
    }
    // A single-wave order never reuses a slot: its whole pool must fit the ring.
    if (threadIdx.x == 0 && !overflow && p.lag_units >= p.max_blocks && tab.scalars[1] > p.ring_blocks)
        sync::fail_wait(sync::WaitSite::kRingOverflow, p.wait, 0, p.ring_blocks, tab.scalars[1], 0);
    if (!overflow) {
        for (u32 i = gtid; i < pairs; i += grid_threads) {
            const i32 e = moe::local_expert<IdxT>(m, i);
            if (e < 0) continue;
            const u32 row = static_cast<u32>(tab.row_begin[e]) + atomicAdd(bank + p.bank.cursors + e, 1u);
            const u32 token = i / m.num_topk, slot = i % m.num_topk;
            m.pool_src[row] = static_cast<i32>(i);
            m.pool_weight[row] = m.topk_weights[i];
            m.pool_dst[row] = reinterpret_cast<u64>(m.combine) +
                              (static_cast<u64>(slot) * m.token_capacity + token) * m.hidden * 2ull;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        sync::grid_barrier_acq_rel_gpu(p.grid_barrier, gridDim.x, p.wait);
        trace(p, kTraceClaimed);
    }
    __syncthreads();
}

// Across ranks: the routing of the header comment of fused/expert_parallel.cuh.
template <class IdxT, Role kRole>
__device__ __forceinline__ void route_and_claim_across_ranks(const FusedParams& p, const RoutingTables& tab) {
    const moe::MoeParams& m = p.moe;
    u32* bank = tab.bank(p);
    const u32 b = tab.scalars[3] & 1;
    const u32 el = m.num_local_experts;
    const u32 grid_threads = ptx::nctaid_x() * kNumThreads;
    const u32 gtid = ptx::ctaid_x() * kNumThreads + threadIdx.x;
    u32* next_bank = p.banks[b ^ 1];
    u32* next_ep_bank = p.ep_banks + (b ^ 1) * p.ep_bank.words;
    if constexpr (kRole == Role::kFused)  // the split graph's memset node zeroes the banks
        for (u32 i = gtid; i < p.bank.words; i += grid_threads) next_bank[i] = 0;
    // Peers write this rank's EP banks, so no memset may touch them: every role zeroes the next.
    for (u32 i = gtid; i < p.ep_bank.words; i += grid_threads) next_ep_bank[i] = 0;
    const EpScratch ep(tab.end(el), m.num_experts, el);

    // This rank's pairs per global expert.
    const u32 pairs = m.num_tokens * m.num_topk;
    i32* hist = ep.send_offsets;  // scratch until the scan
    for (u32 e = threadIdx.x; e < m.num_experts; e += kNumThreads) hist[e] = 0;
    __syncthreads();
    for (u32 i = gtid; i < pairs; i += grid_threads) {
        const i32 g = moe::global_expert<IdxT>(m, i);
        if (g >= 0) atomicAdd(&hist[g], 1);
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < m.num_experts; e += kNumThreads)
        if (hist[e]) atomicAdd(bank + p.bank.counts + e, static_cast<u32>(hist[e]));
    __syncthreads();
    if (threadIdx.x == 0) {
        sync::grid_barrier_acq_rel_gpu(p.grid_barrier, ptx::nctaid_x(), p.wait);
        trace(p, kTraceCounted);
    }
    __syncthreads();

    // The send list, grouped by global expert (so by destination rank first).
    if (threadIdx.x < 32) scan_send_offsets(bank + p.bank.counts, m.num_experts, ep.send_offsets);
    __syncthreads();
    for (u32 i = gtid; i < pairs; i += grid_threads) {
        const i32 g = moe::global_expert<IdxT>(m, i);
        if (g < 0) continue;
        const u32 pos = static_cast<u32>(ep.send_offsets[g]) + atomicAdd(bank + p.bank.cursors + g, 1u);
        p.send_list[pos] = (static_cast<u64>(__float_as_uint(m.topk_weights[i])) << 32) | i;
    }
    __syncthreads();
    if (threadIdx.x == 0) sync::grid_barrier_acq_rel_gpu(p.grid_barrier, ptx::nctaid_x(), p.wait);
    __syncthreads();

    // Block d publishes to rank d: counts and send-list offsets, then its count_ready word.
    for (u32 d = ptx::ctaid_x(); d < p.num_ranks; d += ptx::nctaid_x()) {
        for (u32 e = threadIdx.x; e < el; e += kNumThreads) {
            const u32 word = p.rank * el + e;
            *ep_peer_word(p, d, b, p.ep_bank.recv_counts + word) = bank[p.bank.counts + d * el + e];
            *ep_peer_word(p, d, b, p.ep_bank.recv_offsets + word) = static_cast<u32>(ep.send_offsets[d * el + e]);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            ptx::fence_acq_rel_sys();
            ptx::st_release_sys_u32(ep_peer_word(p, d, b, p.ep_bank.count_ready + p.rank), 1);
        }
        __syncthreads();
    }

    // Every block: all sources' counts, then the pool by (local expert, source rank).
    const u32* own = ep_own_bank(p, b);
    if (threadIdx.x < p.num_ranks)  // one thread per source: no trap inside a loop
        sync::wait_ge_acquire_sys_u32_quiet(own + p.ep_bank.count_ready + threadIdx.x, 1,
                                            sync::WaitSite::kExpertCountsArrived, p.wait, threadIdx.x);
    __syncthreads();
    for (u32 e = threadIdx.x; e < el; e += kNumThreads) {
        u32 total = 0;
        for (u32 s = 0; s < p.num_ranks; ++s) total += own[p.ep_bank.recv_counts + s * el + e];
        ep.totals[e] = static_cast<i32>(total);
    }
    __syncthreads();
    if (threadIdx.x < 32) build_tables(p, reinterpret_cast<const u32*>(ep.totals), tab);
    __syncthreads();
    for (u32 e = threadIdx.x; e < el; e += kNumThreads) {
        i32* rows = ep.src_rows + e * (p.num_ranks + 1);
        i32 row = tab.row_begin[e];
        for (u32 s = 0; s < p.num_ranks; ++s) {
            rows[s] = row;
            row += static_cast<i32>(own[p.ep_bank.recv_counts + s * el + e]);
        }
        rows[p.num_ranks] = row;
    }
    const bool overflow = tab.scalars[2] != 0;
    if (ptx::ctaid_x() == 0) {
        for (u32 e = threadIdx.x; e <= el; e += kNumThreads) {
            m.expert_offsets[e] = tab.row_begin[e];
            if (e < el && m.expert_recv_stats != nullptr) m.expert_recv_stats[e] += ep.totals[e];
        }
        if (threadIdx.x == 0 && overflow)
            errors::report_error(m.errors, errors::ErrorKind::kPoolOverflow, tab.scalars[1] * kBlockM,
                                 p.max_blocks * kBlockM);
    }
    if (threadIdx.x == 0 && !overflow && p.lag_units >= p.max_blocks && tab.scalars[1] > p.ring_blocks)
        sync::fail_wait(sync::WaitSite::kRingOverflow, p.wait, 0, p.ring_blocks, tab.scalars[1], 0);
    __syncthreads();
    if (threadIdx.x == 0) trace(p, kTraceClaimed);
}

// A streamed call, every block: no routing phase, so the next launch's bank is zeroed here
// (as the routing phase does) and nothing overflows (the pool is the worst case's).
__device__ __forceinline__ void begin_streamed_call(const FusedParams& p, const RoutingTables& tab) {
    u32* next_bank = p.banks[(tab.scalars[3] & 1) ^ 1];
    for (u32 i = ptx::ctaid_x() * kNumThreads + threadIdx.x; i < p.bank.words; i += ptx::nctaid_x() * kNumThreads)
        next_bank[i] = 0;
    if (threadIdx.x == 0) {
        tab.scalars[2] = 0;
        trace(p, kTraceCounted);
        trace(p, kTraceClaimed);
    }
    __syncthreads();
}

// Split K2, every block: once K1 has published the routing, the same tables from the same
// counts (its own, or every source's in this rank's EP bank across ranks).
template <bool kEp>
__device__ __forceinline__ void wait_routing_and_build_tables(const FusedParams& p, const RoutingTables& tab) {
    const u32* bank = tab.bank(p);
    if (threadIdx.x == 0) {
        // Stuck only if K1 is: K1's own waits (peers' counts, its grid barriers) must trap
        // first, so that the report names the wait that actually hung.
        sync::wait_ge_acquire_gpu_u32(bank + p.bank.routing_published, 1, sync::WaitSite::kSplitRoutingPublished,
                                      p.wait, 0, sync::kPeerStallShift);
        trace(p, kTraceCounted);
    }
    __syncthreads();
    const u32* counts = bank + p.bank.counts;
    if constexpr (kEp) {
        const u32 el = p.moe.num_local_experts;
        const EpScratch ep(tab.end(el), p.moe.num_experts, el);
        const u32* own = ep_own_bank(p, tab.scalars[3] & 1);
        for (u32 e = threadIdx.x; e < el; e += kNumThreads) {
            u32 total = 0;
            for (u32 s = 0; s < p.num_ranks; ++s) total += own[p.ep_bank.recv_counts + s * el + e];
            ep.totals[e] = static_cast<i32>(total);
        }
        __syncthreads();
        counts = reinterpret_cast<const u32*>(ep.totals);
    }
    if (threadIdx.x < 32) build_tables(p, counts, tab);
    __syncthreads();
    if (threadIdx.x == 0) trace(p, kTraceClaimed);
}

// Across ranks, after every block's last tile (thread 128 of block 0, past the grid
// barrier): tell every rank its partials are in its combine buffer.
__device__ __forceinline__ void signal_partials_ready(const FusedParams& p, const RoutingTables& tab) {
    const u32 b = tab.scalars[3] & 1;
    ptx::fence_acq_rel_sys();  // the partials every block stored before the grid barrier
    for (u32 d = 0; d < p.num_ranks; ++d)
        ptx::st_release_sys_u32(ep_peer_word(p, d, b, p.ep_bank.combine_ready + p.rank), 1);
}

// Across ranks, by the relay thread's warp once the math warpgroups are through their tiles:
// lane s waits until rank s's partials are in this rank's combine buffer (this rank's own
// word is set past the grid barrier, so this also waits for that), then the whole warp
// releases the math warps into the combine. Waiting here keeps the waits (and their traps)
// out of the math warpgroups' registers. At most 32 ranks (checked on the host).
__device__ __forceinline__ void wait_partials_from_every_rank(const FusedParams& p, const RoutingTables& tab) {
    const u32 lane = threadIdx.x % 32;
    if (lane < p.num_ranks)
        sync::wait_ge_acquire_sys_u32_quiet(ep_own_bank(p, tab.scalars[3] & 1) + p.ep_bank.combine_ready + lane, 1,
                                            sync::WaitSite::kCombineArrived, p.wait, lane, sync::kPeerStallShift);
    __syncwarp();
    ptx::bar_arrive(kPartialsBarrier, 32 + kNumThreads - 128);
}

// The GEMM tile of an order position: metadata rows are global pool rows, A and D rows
// are the block's ring slot (b_row0 is set per layer).
__device__ __forceinline__ gemm::Tile ring_tile(const FusedParams& p, const RoutingTables& tab, const OrderedTile& s) {
    gemm::Tile tile{};
    tile.valid = true;
    tile.group = s.expert;
    tile.row0 = s.block * kBlockM;
    tile.a_row0 = tile.d_row0 = (s.block % p.ring_blocks) * kBlockM;
    tile.rows = tab.block_rows(s.expert, s.block);
    tile.n0 = s.n_block * kBlockN;
    return tile;
}

// The tiles a launch of role kRole walks: both layers in the lag task order, or one.
// A streamed call has none: its producer hands over resolved tiles.
struct NoTaskOrder {};

template <Role kRole>
__device__ __forceinline__ auto role_task_order(const FusedParams& p, const RoutingTables& tab) {
    const u32 n1 = p.l1.n / kBlockN, n2 = p.l2.n / kBlockN;
    if constexpr (kRole == Role::kStreamed) {
        return NoTaskOrder{};
    } else if constexpr (kRole == Role::kFused) {
        return LagTaskOrder(tab.units(p.moe.num_local_experts), p.lag_units, p.group_units, n1, n2);
    } else {
        return LayerTaskOrder(tab.units(p.moe.num_local_experts), kRole == Role::kSplitL2 ? n2 : n1,
                              kRole == Role::kSplitL2);
    }
}

// The producer's loads of one tile of a layer (`g`: its GEMM's parameters), once the tile's
// waits are through: its A rows were written with generic stores in another block, so the
// proxy fence comes first; B is the tile's expert's weight rows.
template <class L>
__device__ __forceinline__ void load_layer_tile(const gemm::GemmParams& g, gemm::Tile& tile, u32 expert,
                                                const gemm::SharedStorage<L>& sm, gemm::PipelineState<L::kStages>& st,
                                                const ptx::TmaDescriptor* tma_a, const ptx::TmaDescriptor* tma_b,
                                                const ptx::TmaDescriptor* tma_sfa,
                                                const sync::MbarrierDeadline& deadline) {
    ptx::fence_proxy_async_global();
    tile.b_row0 = expert * g.n + tile.n0;
    gemm::produce_tile<L>(tile, g.k / L::kBlockK, sm, st, tma_a, tma_b, tma_sfa, 0, deadline);
}

template <u32 kStages, u32 kActSfGran, Role kRole>
__device__ __forceinline__ void produce_tiles(const FusedParams& p, const RoutingTables& tab, u8* smem,
                                              const ptx::TmaDescriptor* tma_l1_a, const ptx::TmaDescriptor* tma_l1_b,
                                              const ptx::TmaDescriptor* tma_l1_sfa, const ptx::TmaDescriptor* tma_l2_a,
                                              const ptx::TmaDescriptor* tma_l2_b,
                                              const ptx::TmaDescriptor* tma_l2_sfa) {
    using L1 = L1Config<kStages, kActSfGran>;
    using L2 = L2Config<kStages, kActSfGran>;
    const gemm::SharedStorage<L1> sm1{smem};
    const gemm::SharedStorage<L2> sm2{smem};
    u32* bank = tab.bank(p);
    const u32 n1 = p.l1.n / kBlockN, n2 = p.l2.n / kBlockN;
    auto order = role_task_order<kRole>(p, tab);
    u32* ticket = bank + (kRole == Role::kSplitL2 ? p.bank.l2_ticket : p.bank.ticket);
    gemm::PipelineState<kStages> st;
    TileQueueCursor queue;
    OrderedTile s;
    // The next ticket is taken while this tile's loads are issued, so the atomic's round trip
    // is off the path between tiles (holding one position ahead keeps the task order: it is
    // started right after the current one, which depends on earlier positions only).
    u32 next = atomicAdd(ticket, 1u);
    const sync::MbarrierDeadline deadline{p.wait, sync::kIntraBlockWaitShift};
    bool traced_l1 = false;
    for (;;) {
        const u32 t = next;
        push_ticket(tab.tiles, queue, t, deadline);  // past the end too: it tells the math warpgroups to stop
        if (!order.tile(t, s)) break;
        next = atomicAdd(ticket, 1u);
        gemm::Tile tile = ring_tile(p, tab, s);
        if (!s.l2) {
            trace_first_l1(p, traced_l1);
            {
                // Past the first ring pass the rows themselves wait on a freed slot: a derived wait.
                const TracedWait timed(p, kTraceWaitRowsNs);
                sync::wait_ge_acquire_gpu_u32(bank + p.bank.arrivals + s.block, tile.rows,
                                              sync::WaitSite::kL1RowsArrived, p.wait, s.block,
                                              s.block >= p.ring_blocks ? sync::kDerivedWaitShift : 0u);
            }
            // The epilogue of this tile overwrites the activation slot of block - ring_blocks.
            if (s.block >= p.ring_blocks) {
                const TracedWait timed(p, kTraceWaitRingNs);
                sync::wait_ge_acquire_gpu_u32(bank + p.bank.l2_read + s.block - p.ring_blocks, n2,
                                              sync::WaitSite::kRingSlotFree, p.wait, s.block, sync::kDerivedWaitShift);
            }
            load_layer_tile<L1>(p.l1, tile, s.expert, sm1, st, tma_l1_a, tma_l1_b, tma_l1_sfa, deadline);
        } else {
            {
                const TracedWait timed(p, kTraceWaitL1OutNs);
                sync::wait_ge_acquire_gpu_u32(bank + p.bank.l1_done + s.block, n1, sync::WaitSite::kL1OutputPublished,
                                              p.wait, s.block, sync::kDerivedWaitShift);
            }
            load_layer_tile<L2>(p.l2, tile, s.expert, sm2, st, tma_l2_a, tma_l2_b, tma_l2_sfa, deadline);
        }
    }
    // L1 and L2 tiles share the stages' barriers (one pipeline state): one drain covers both.
    gemm::drain_stages<L1>(sm1, st, deadline);
}

// A streamed call's producer: tickets in the lag order over ready-list positions, each resolved
// to its block before the math warpgroups get it (fused/streamed_call.cuh).
template <u32 kStages, u32 kActSfGran>
__device__ __forceinline__ void produce_streamed_tiles(
    const FusedParams& p, const RoutingTables& tab, u8* smem, const ptx::TmaDescriptor* tma_l1_a,
    const ptx::TmaDescriptor* tma_l1_b, const ptx::TmaDescriptor* tma_l1_sfa, const ptx::TmaDescriptor* tma_l2_a,
    const ptx::TmaDescriptor* tma_l2_b, const ptx::TmaDescriptor* tma_l2_sfa) {
    using L1 = L1Config<kStages, kActSfGran>;
    using L2 = L2Config<kStages, kActSfGran>;
    const gemm::SharedStorage<L1> sm1{smem};
    const gemm::SharedStorage<L2> sm2{smem};
    u32* bank = tab.bank(p);
    const u32 n1 = p.l1.n / kBlockN;
    const StreamOrder order{p.streamed.lag, n1, p.l2.n / kBlockN};
    gemm::PipelineState<kStages> st;
    TileQueueCursor queue;
    const sync::MbarrierDeadline deadline{p.wait, sync::kIntraBlockWaitShift};
    // As in produce_tiles, the next ticket is taken while this tile's loads are issued.
    u32 next = atomicAdd(bank + p.bank.ticket, 1u);
    bool traced_l1 = false;
    for (;;) {
        StreamTask task;
        if (!fixed_stream_task(p.streamed.ready, order, next, p.wait, sync::kDerivedWaitShift, task)) {
            push_ticket(tab.tiles, queue, StreamTileWord::kEnd, deadline);  // tells the math warpgroups to stop
            break;
        }
        next = atomicAdd(bank + p.bank.ticket, 1u);
        // Complete (an L1 task's position is fixed only once its block is on the list; an L2
        // task's comes lag positions before the one that fixed it), or soon after the seal.
        u32 block;
        {
            const TracedWait timed(p, kTraceWaitRowsNs);  // a complete block: its rows are written
            block = stream::wait_ready_position(p.streamed.ready, task.position, p.wait, sync::kDerivedWaitShift);
        }
        push_ticket(tab.tiles, queue, StreamTileWord::encode(task.l2, block, task.tile), deadline);
        gemm::Tile tile = streamed_tile(p, block, task.tile);
        if (!task.l2) {
            trace_first_l1(p, traced_l1);
            load_layer_tile<L1>(p.l1, tile, tile.group, sm1, st, tma_l1_a, tma_l1_b, tma_l1_sfa, deadline);
        } else {
            {
                const TracedWait timed(p, kTraceWaitL1OutNs);
                sync::wait_ge_acquire_gpu_u32(bank + p.bank.l1_done + block, n1, sync::WaitSite::kL1OutputPublished,
                                              p.wait, block, sync::kDerivedWaitShift);
            }
            load_layer_tile<L2>(p.l2, tile, tile.group, sm2, st, tma_l2_a, tma_l2_b, tma_l2_sfa, deadline);
        }
    }
    gemm::drain_stages<L1>(sm1, st, deadline);
}

template <u32 kStages, u32 kActSfGran, Role kRole>
__device__ __forceinline__ void compute_tiles(const FusedParams& p, const RoutingTables& tab, u8* smem) {
    using L1 = L1Config<kStages, kActSfGran>;
    using L2 = L2Config<kStages, kActSfGran>;
    const gemm::SharedStorage<L1> sm1{smem};
    const gemm::SharedStorage<L2> sm2{smem};
    // Warp-uniform (ptx/warp_uniform.cuh), as the tile's kind below: the wgmma descriptors stay in
    // uniform registers.
    const u32 math_wg = ptx::warpgroup_index_uniform() - 1;
    const gemm::MathThread<L1> mt1(math_wg);
    const gemm::MathThread<L2> mt2(math_wg);
    const bool leader = threadIdx.x == 128;
    const SignalRelay& relay = tab.relay;
    u32 posted = 0;
    auto order = role_task_order<kRole>(p, tab);
    gemm::PipelineState<kStages> st;
    TileQueueCursor queue;
    float acc[64];
    float out[64];
    OrderedTile s;
    for (;;) {
        const u32 t = ptx::warp_uniform(pop_ticket(tab.tiles, queue, threadIdx.x % 32));
        gemm::Tile tile;
        if constexpr (kRole == Role::kStreamed) {
            if (t & StreamTileWord::kEnd) break;
            s.l2 = (t & StreamTileWord::kL2) != 0;
            s.block = StreamTileWord::block(t);
            tile = streamed_tile(p, s.block, StreamTileWord::n_block(t));
        } else {
            if (!ptx::warp_uniform(order.tile(t, s))) break;
            tile = ring_tile(p, tab, s);
        }
        if (!ptx::warp_uniform(s.l2)) {
            gemm::consume_tile<L1>(p.l1, tile, p.l1.k / L1::kBlockK, sm1, st, mt1, acc, out, 0);
            L1::Epilogue::template store<L1>(p.l1_out, tile, mt1, sm1, out);
            // Every math thread's rows are written before the leader posts them (TMA reads them
            // in another block: the relay adds the proxy fence).
            ptx::bar_sync(kMathBarrier, L1::kNumMathThreads);
            const bool withheld = kRole == Role::kSplitL1 && s.block == p.withhold_block;
            if (leader && !withheld) relay.post(posted, (p.bank.l1_done + s.block) | SignalRelay::kProxyFence);
        } else {
            gemm::consume_tile<L2>(p.l2, tile, p.l2.k / L2::kBlockK, sm2, st, mt2, acc, out, 0);
            // The leader has seen every stage of this tile land: its activation rows are read.
            if (leader) relay.post(posted, p.bank.l2_read + s.block);
            L2::Epilogue::template store<L2>(p.l2_out, tile, mt2, sm2, out);
        }
    }
    if (leader) relay.post(posted, SignalRelay::kStop);
}

template <u32 kStages, u32 kActSfGran, typename IdxT, bool kEp, Role kRole>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_fp8_fused_moe(const __grid_constant__ FusedParams p, const __grid_constant__ ptx::TmaDescriptor tma_l1_a,
                       const __grid_constant__ ptx::TmaDescriptor tma_l1_b,
                       const __grid_constant__ ptx::TmaDescriptor tma_l1_sfa,
                       const __grid_constant__ ptx::TmaDescriptor tma_l2_a,
                       const __grid_constant__ ptx::TmaDescriptor tma_l2_b,
                       const __grid_constant__ ptx::TmaDescriptor tma_l2_sfa) {
    using L1 = L1Config<kStages, kActSfGran>;
    using L2 = L2Config<kStages, kActSfGran>;
    static_assert(L1::kSmemBytes == L2::kSmemBytes && L1::kOffBarriers == L2::kOffBarriers,
                  "L1 and L2 tiles must share one shared-memory carve-up");
    static_assert(L1::kNumThreads == kNumThreads && L2::kNumThreads == kNumThreads,
                  "one producer + two math warpgroups");
    // The host puts the routing tables at tile_smem_bytes(kStages) (FusedParams::table_smem_offset).
    static_assert(L1::kSmemBytes == tile_smem_bytes(kStages), "the GEMM carve-up differs from the host's size");
    const moe::MoeParams& m = p.moe;
    extern __shared__ u8 smem_raw[];
    const u32 raw_addr = ptx::smem_addr_u32(smem_raw);
    u8* smem = smem_raw + ((1024 - raw_addr % 1024) % 1024);
    const RoutingTables tab(smem + p.table_smem_offset, m.num_local_experts);
    const gemm::SharedStorage<L1> sm1{smem};

    if (threadIdx.x == 0) {
        // The host sizes shared memory from the same generated formulas; a mismatch is a bug.
        if (ptx::dynamic_smem_size() < p.table_smem_offset + RoutingTables::bytes(m.num_local_experts) +
                                           ep_scratch_smem_bytes<kEp>(p) + L1::kSmemAlignSlack)
            __trap();
        for (u32 s = 0; s < kStages; ++s) {
            ptx::mbarrier_init_shared(sm1.full(s), 1);
            ptx::mbarrier_init_shared(sm1.empty(s), L1::kEmptyArrivals);
        }
        tab.tiles.init(L1::kNumMathThreads / 32);
        tab.relay.init();
        ptx::fence_mbarrier_init_release_cluster();
        ptx::prefetch_tensormap(&tma_l1_a);
        ptx::prefetch_tensormap(&tma_l1_b);
        ptx::prefetch_tensormap(&tma_l1_sfa);
        ptx::prefetch_tensormap(&tma_l2_a);
        ptx::prefetch_tensormap(&tma_l2_b);
        ptx::prefetch_tensormap(&tma_l2_sfa);
    }
    // Everything above overlaps the previous kernel under programmatic dependent launch; from
    // here on the inputs and this buffer's workspace (the previous launch's) are read.
    ptx::griddepcontrol_wait();
    if (threadIdx.x == 0) {
        trace(p, kTraceStart);
        if (p.trace != nullptr) p.trace[ptx::ctaid_x() * kTraceEvents + kTraceSm] = ptx::smid();
        // Launch parity: this launch counts in one bank and clears the other for the next launch.
        tab.scalars[3] = ptx::ld_relaxed_gpu_u32(p.launch_epoch);
    }
    for (u32 e = threadIdx.x; e < m.num_local_experts; e += kNumThreads) tab.row_end[e] = 0;  // count scratch
    __syncthreads();
    if constexpr (kRole == Role::kStreamed) {
        static_assert(!kEp && sizeof(IdxT) == 4, "a streamed call runs on one rank; the ring holds i32 ids");
        begin_streamed_call(p, tab);
    } else if constexpr (kRole == Role::kSplitL2) {
        wait_routing_and_build_tables<kEp>(p, tab);
    } else if constexpr (kEp) {
        route_and_claim_across_ranks<IdxT, kRole>(p, tab);
    } else {
        route_and_claim<IdxT, kRole>(p, tab);
    }
    // Split K1: the pool is laid out and claimed (past the grid barrier; across ranks, past this
    // block's acquires of every source's counts), so K2 may build its tables.
    if constexpr (kRole == Role::kSplitL1) {
        if (threadIdx.x == 0 && ptx::ctaid_x() == 0) publish_routing(p, tab);
    }

    // --- dispatch and both GEMMs in the lag task order ---------------------------------------
    if (threadIdx.x < 128) {
        ptx::setmaxnreg_dec_sync_aligned<kRole == Role::kFused ? kProducerRegs : kSplitProducerRegs>();
        if (threadIdx.x / 32 == kRelayThread / 32) {
            if (threadIdx.x == kRelayThread && !tab.overflow())
                tab.relay.run(tab.bank(p), sync::MbarrierDeadline{p.wait, sync::kIntraBlockWaitShift});
            if constexpr (kEp && kRole == Role::kFused) {
                // The relay's warp stays whole: it also waits for every rank's partials and
                // releases the math warps into the combine, overflow or not (peers still
                // signal this launch).
                __syncwarp();
                wait_partials_from_every_rank(p, tab);
            }
            return;
        }
        if (tab.overflow()) return;
        if (threadIdx.x == 0) {
            if constexpr (kRole == Role::kStreamed) {
                produce_streamed_tiles<kStages, kActSfGran>(p, tab, smem, &tma_l1_a, &tma_l1_b, &tma_l1_sfa, &tma_l2_a,
                                                            &tma_l2_b, &tma_l2_sfa);
            } else {
                produce_tiles<kStages, kActSfGran, kRole>(p, tab, smem, &tma_l1_a, &tma_l1_b, &tma_l1_sfa, &tma_l2_a,
                                                          &tma_l2_b, &tma_l2_sfa);
            }
            trace(p, kTraceProducerDone);
        } else if (kRole != Role::kSplitL2 && threadIdx.x >= 32 && threadIdx.x < 32 * (1 + kNumDispatchWarps)) {
            if constexpr (kRole == Role::kStreamed) {
                dispatch_streamed_chunks<kStreamedCopyBatch>(
                    p, ptx::ctaid_x() * kNumDispatchWarps + threadIdx.x / 32 - 1, ptx::nctaid_x() * kNumDispatchWarps);
            } else {
                dispatch_rows<kEp, kRole>(p, tab);
            }
            if (threadIdx.x == 32) trace(p, kTraceDispatchDone);
        }
        return;
    }
    ptx::setmaxnreg_inc_sync_aligned<kMathRegs>();
    if (!tab.overflow()) compute_tiles<kStages, kActSfGran, kRole>(p, tab, smem);
    if constexpr (kRole == Role::kSplitL1) {
        if (threadIdx.x == 128) trace(p, kTraceMathDone);
        return;
    } else if constexpr (kRole == Role::kSplitL2) {
        // Across ranks, once every block's partials are out, every rank learns its are in (K3
        // waits for that); on one rank the graph's edge to K3 is enough.
        if constexpr (kEp) ptx::bar_sync(kMathBarrier, L1::kNumMathThreads);
        if (threadIdx.x == 128) {
            trace(p, kTraceMathDone);
            if constexpr (kEp) {
                ptx::fence_acq_rel_sys();
                sync::grid_barrier_acq_rel_gpu(p.grid_barrier, gridDim.x, p.wait);
                trace(p, kTraceAllTilesDone);
                if (blockIdx.x == 0) signal_partials_ready(p, tab);
            }
        }
        return;
    }

    // --- combine, once every block's L2 partials are in -----------------------------------------
    ptx::bar_sync(kMathBarrier, L1::kNumMathThreads);
    if (threadIdx.x == 128) {
        trace(p, kTraceMathDone);
        // Across ranks this block's partials went to peers over NVLink: publish them at system
        // scope before the grid barrier block 0's signals to the peers depend on.
        if constexpr (kEp) ptx::fence_acq_rel_sys();
        sync::grid_barrier_acq_rel_gpu(p.grid_barrier, gridDim.x, p.wait);
        trace(p, kTraceAllTilesDone);
        if constexpr (kEp) {
            if (blockIdx.x == 0) signal_partials_ready(p, tab);
        }
        if (blockIdx.x == 0) ptx::st_relaxed_gpu_u32(p.launch_epoch, tab.scalars[3] + 1);
        // The next kernel may begin launching; it waits for this one to finish before reading.
        ptx::griddepcontrol_launch_dependents();
    }
    if constexpr (kEp) {
        ptx::bar_sync(kPartialsBarrier, 32 + L1::kNumMathThreads);
    } else {
        ptx::bar_sync(kMathBarrier, L1::kNumMathThreads);
    }
    const u32 math_wg = threadIdx.x / 128 - 1;
    for (u32 token = blockIdx.x * 2 + math_wg; token < m.num_tokens; token += gridDim.x * 2) {
        const u32 mask = tab.overflow() ? 0u : moe::valid_slot_mask<IdxT>(m, token);
        moe::combine_token(m, token, mask, threadIdx.x % 128, 128);
    }
    if (threadIdx.x == 128) trace(p, kTraceCombineDone);
}

}  // namespace megamoe_rt::fused
