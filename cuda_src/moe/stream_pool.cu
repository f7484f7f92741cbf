// A streamed call's one pool (the unfused layer on one rank; the model:
// megamoe_rt/schedule/stream_seal.py).
//
// Chunks arrive one at a time, so no expert's row count is known before the last one. The
// batch call lays the experts out first (count -> scan -> dispatch); a streamed call cannot.
// Instead every chunk's pairs claim rows of their expert as the chunk arrives, a block of
// pool_align rows at a time from one call-wide block counter, and copy their rows in, after
// which the chunk's slot can be reused. Once the last chunk is in, the seal lays the experts
// out over the claimed blocks: the batch call's block-aligned exclusive scan, plus a block map
// telling the GEMMs which pool block holds each laid-out block (GemmParams::block_map). An
// expert takes ceil(rows / pool_align) blocks, as in the batch call, and the GEMMs run once
// over the whole call, so each expert's weights are read once however many chunks fed it.
//
// Rows inside an expert follow the atomic claims; every output depends only on its own row,
// so the result is the batch call's, bit for bit.

#include "common/types.cuh"
#include "moe/params.cuh"
#include "moe/pool_row.cuh"
#include "moe/route_count.cuh"
#include "ptx/ld_st.cuh"
#include "stream/producer.cuh"
#include "sync/deadline_wait.cuh"

namespace megamoe_rt::moe {

// The consumer's footprint on an SM. Its blocks sit beside the producer's (a router kernel of
// 256 threads at 64 registers runs four blocks an SM alone), and every register the consumer
// holds is one the producer's blocks cannot have: at 80 registers x 256 threads only two router
// blocks fit beside it, at 64 three. Four loads in flight per lane instead of eight keep it
// under 64 without spilling (ptxas: 62).
constexpr u32 kConsumeMinBlocks = 4;
constexpr u32 kConsumeCopyBatch = 4;

// expert_blocks entries: 0 until claimed, then the pool block + 1, or kNoBlock when the claim
// found the pool full (reported).
constexpr u32 kNoBlock = 0xFFFFFFFFu;

// Lane 0 of a warp: the pool row of the next row of local expert `e`, or -1 (pool overflow,
// reported). The row that opens one of the expert's blocks claims a pool block for it; rows
// falling in the same block wait until it is claimed. The claiming thread has already taken
// its row when the others see theirs, so it is running and the wait is short.
__device__ __forceinline__ i32 claim_pool_row(const StreamPoolParams& sp, u32 e) {
    const MoeParams& p = sp.moe;
    const u32 n = static_cast<u32>(atomicAdd(&p.expert_counts[e], 1));
    const u32 j = n / p.pool_align;
    if (j >= sp.blocks_per_expert) {  // more rows than tokens: cannot happen with the host's sizing
        errors::report_error(p.errors, errors::ErrorKind::kPoolOverflow, (j + 1) * p.pool_align,
                             sp.blocks_per_expert * p.pool_align);
        return -1;
    }
    u32* entry = reinterpret_cast<u32*>(sp.expert_blocks + static_cast<u64>(e) * sp.blocks_per_expert + j);
    u32 seen;
    if (n % p.pool_align == 0) {
        const u32 b = atomicAdd(sp.blocks_claimed, 1u);
        seen = b < sp.pool_blocks ? b + 1 : kNoBlock;
        if (seen == kNoBlock)
            errors::report_error(p.errors, errors::ErrorKind::kPoolOverflow, (b + 1) * p.pool_align,
                                 sp.pool_blocks * p.pool_align);
        ptx::st_release_gpu_u32(entry, seen);
    } else {
        seen = sync::wait_ge_acquire_sys_u32(entry, 1u, sync::WaitSite::kStreamPoolBlockClaimed, sp.wait, e);
    }
    if (seen == kNoBlock) return -1;
    return static_cast<i32>((seen - 1) * p.pool_align + n % p.pool_align);
}

// Warp `warp` of the launch's `num_warps`, over the (token, slot) pairs of the chunk `m` describes
// (m: the chunk as a call of its own, its inputs in its ring slot, token_base its first token of
// the call). Pairs are dealt out a lane at a time across every warp (pair base + lane * num_warps
// + warp), so a chunk smaller than the launch still keeps every warp copying. Every lane
// classifies its own pair and claims its row, so the claims' atomics are in flight together,
// and writes the row's metadata; then the warp copies its lanes' rows one by one. Every pair also
// keeps its expert id for the combine (the slot is reused before the combine runs).
__device__ __forceinline__ void dispatch_chunk_pairs(const StreamPoolParams& sp, const MoeParams& m, u32 warp,
                                                     u32 num_warps, u32 lane) {
    const u32 pairs = m.num_tokens * m.num_topk;
    for (u32 base = 0; base < pairs; base += num_warps * 32) {
        const u32 pair = base + lane * num_warps + warp;
        i32 row = -1;
        if (pair < pairs) {
            const u32 call_pair = m.token_base * m.num_topk + pair;
            sp.call_topk_idx[call_pair] = static_cast<i32>(load_expert_id<i32>(m, pair));
            const i32 e = local_expert<i32>(m, pair);
            // A lane may wait here for a block another lane of this warp opens: the opener took its
            // row first and does not wait, and diverged lanes make progress independently (sm_70+).
            if (e >= 0) row = claim_pool_row(sp, static_cast<u32>(e));
        }
        if (row >= 0) {
            const u32 token = pair / m.num_topk, slot = pair % m.num_topk;
            m.pool_src[row] = static_cast<i32>(m.token_base * m.num_topk + pair);
            m.pool_weight[row] = m.topk_weights[pair];
            m.pool_dst[row] = reinterpret_cast<u64>(m.combine) +
                              (static_cast<u64>(slot) * m.token_capacity + m.token_base + token) * m.hidden * 2ull;
        }
        for (u32 todo = __ballot_sync(0xFFFFFFFFu, row >= 0); todo != 0; todo &= todo - 1) {
            const u32 j = __ffs(todo) - 1;
            const u32 r = static_cast<u32>(__shfl_sync(0xFFFFFFFFu, row, j));
            // The slot is rewritten during the launch: copy_token_row<true> reads it through L2.
            copy_token_row<true, kConsumeCopyBatch>(m, (base + j * num_warps + warp) / m.num_topk, r, lane);
        }
    }
}

// Every chunk of a call in one launch, so the host launches nothing per chunk. The blocks form
// cp.chunk_groups groups that take the chunks in turn (group g: chunks g, g + groups, ...), so
// that many chunks are consumed at once: one chunk's chain of waits, claims and copies is
// latency, not work, and a producer that publishes several chunks together would otherwise
// wait on them one after another. In each group, thread 0 of a block waits until both halves
// of the chunk carry the call's generation, the group's blocks claim and copy their shares of
// the chunk's pairs, and the last block done releases the slot. Blocks never wait for each
// other (only for the producer and for a block claim, whose claimant is running), so they need
// not be resident together. The host puts at most one block on an SM and asks for the SMs' full
// shared memory, so the producer's blocks find room beside blocks waiting for their chunks.
//
// The slots are rewritten by the producer while this launch runs: the rows are read through
// L2 (ld.global.cg), after each warp's own acquire of the generations. The bound (kConsumeMinBlocks)
// is there because, without it, ptxas held the kernel to 32 registers and spilled.
__global__ void __launch_bounds__(kDispatchThreads, kConsumeMinBlocks)
    moe_stream_consume(const __grid_constant__ StreamConsumeParams cp) {
    const stream::StreamRing& ring = cp.ring;
    const u32 lane = threadIdx.x % 32;
    const u32 warps_per_block = kDispatchThreads / 32;
    const u32 groups = cp.chunk_groups;
    const u32 group_blocks = gridDim.x / groups;  // blocks of each group
    const u32 group_warp = blockIdx.x / groups * warps_per_block + threadIdx.x / 32;
    const u32 epoch = ptx::ld_acquire_gpu_u32(ring.consumer_epoch);  // counted by stream_begin_consume
    const u32 call_tokens = cp.pool.moe.num_tokens;
    for (u32 c = blockIdx.x % groups; c < cp.num_chunks; c += groups) {
        const u32 first = c * ring.tokens_per_slot;
        if (first >= call_tokens) break;  // this rank's tokens end here; later chunks carry none
        const u32 n = min(ring.tokens_per_slot, call_tokens - first);
        const u32 slot = stream::slot_of(ring, c);
        const u64 gen = stream::generation(epoch, c);
        if (threadIdx.x == 0) {
            sync::wait_ge_acquire_sys_u64(ring.route_ready_gen + slot, gen, sync::WaitSite::kStreamRouteReady,
                                          cp.pool.wait, slot);
            sync::wait_ge_acquire_sys_u64(ring.layout_ready_gen + slot, gen, sync::WaitSite::kStreamLayoutReady,
                                          cp.pool.wait, slot);
        }
        __syncthreads();
        if (lane == 0) {  // each warp acquires the published halves itself before reading the slot
            (void)ptx::ld_acquire_sys_u64(ring.route_ready_gen + slot);
            (void)ptx::ld_acquire_sys_u64(ring.layout_ready_gen + slot);
        }
        __syncwarp();
        MoeParams m = cp.pool.moe;
        m.x = stream::chunk_x(ring, c);
        m.x_sf = stream::chunk_x_sf(ring, c);
        m.topk_idx = stream::chunk_topk_idx(ring, c);
        m.topk_weights = stream::chunk_topk_weights(ring, c);
        m.num_tokens = n;
        m.token_base = first;
        dispatch_chunk_pairs(cp.pool, m, group_warp, group_blocks * warps_per_block, lane);
        __syncthreads();  // every warp's reads of the slot are done
        if (threadIdx.x == 0) {
            // The slot's k-th use in this call is done once every block of a group has counted it
            // k times. Uses complete in order: the next chunk in the slot is published only after
            // this one is released.
            const u32 target = group_blocks * (c / ring.num_slots + 1);
            if (ptx::atom_add_acq_rel_gpu_u32(cp.slot_done + slot, 1u) + 1 == target) {
                ptx::fence_acq_rel_sys();
                ptx::st_release_sys_u64(ring.consumed_gen + slot, gen);
            }
        }
    }
}

static_assert(kScanThreads >= kMaxLocalExperts, "the seal gives every local expert a thread");

// One block, after the last chunk's dispatch: expert e's offset is the block-aligned sum of
// the counts before it (as moe_pool_offsets), and its j-th laid-out block is the j-th block it
// claimed. A pool that overflowed (reported by the dispatch) is laid out empty, so that no GEMM
// tile reads a block that was never claimed.
__global__ void __launch_bounds__(kScanThreads) moe_stream_seal(const __grid_constant__ StreamPoolParams sp) {
    const MoeParams& p = sp.moe;
    __shared__ i32 scan[kScanThreads];
    const u32 e = threadIdx.x;
    const u32 el = p.num_local_experts;
    i32 count = e < el ? p.expert_counts[e] : 0;
    const i32 align = static_cast<i32>(p.pool_align);
    const i32 padded = (count + align - 1) / align * align;
    const bool too_many = static_cast<u32>(padded) > sp.blocks_per_expert * p.pool_align;
    scan[e] = padded;
    block_inclusive_scan<kScanThreads>(scan);
    const bool overflow = __syncthreads_or(too_many) || *sp.blocks_claimed > sp.pool_blocks;
    if (overflow) count = 0;
    if (e < el) {
        const i32 first = overflow ? 0 : scan[e] - padded;
        store_expert_range(p, e, first, count);
        const i32* claimed = sp.expert_blocks + static_cast<u64>(e) * sp.blocks_per_expert;  // block + 1
        for (i32 j = 0; j < (count + align - 1) / align; ++j) sp.block_map[first / align + j] = claimed[j] - 1;
    }
    if (e == el - 1) p.expert_offsets[el] = overflow ? 0 : scan[e];
}

}  // namespace megamoe_rt::moe
