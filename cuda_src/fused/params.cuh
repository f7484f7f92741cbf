// Parameters of the fused MoE kernel. Host mirror: megamoe_rt.kernels.fused.FusedParams;
// every pointer, stride and size is resolved there from the buffer layout.
#pragma once

#include "common/types.cuh"
#include "ep/params.cuh"
#include "gemm/params.cuh"
#include "moe/params.cuh"
#include "sync/deadline_wait.cuh"
#include "sync/grid_barrier.cuh"

namespace megamoe_rt::fused {

// Per-launch counters, in one of two banks picked by the launch parity: a launch zeroes
// the other bank for the next one, so back-to-back launches need no memset and no extra
// barrier. Word offsets inside a bank:
struct BankLayout {
    u32 words;         // bank size in u32 words
    u32 counts;        // [num_local_experts] rows routed to each local expert
    u32 cursors;       // [num_local_experts] rows claimed so far
    u32 arrivals;      // [max_blocks] rows landed in each pool block (gates its L1 tiles)
    u32 l1_done;       // [max_blocks] L1 n-tiles published per block (gates L2, frees the pool slot)
    u32 l2_read;       // [max_blocks] L2 n-tiles done reading the block (frees the activation slot)
    u32 ticket;        // [1] next stream position to hand out (fused/tile_queue.cuh)
};

struct FusedParams {
    moe::MoeParams moe;       // inputs, pools (pool_rows = ring rows), per-row metadata (full size), combine, y
    gemm::GemmParams l1;      // n = 2I, k = H; d/d_sf: the activation ring; row_weight: full-size metadata
    gemm::GemmParams l2;      // n = H, k = I; row_dst: full-size metadata
    sync::WaitContext wait;
    u32* banks[2];
    BankLayout bank;
    u32* launch_epoch;        // parity of this word picks the bank; bumped at the end of a launch
    sync::GridBarrierWords* grid_barrier;
    u32 ring_blocks;          // pool / activation slots of BLOCK_M rows
    u32 max_blocks;           // worst-case pool blocks of a call (counters and tables are sized for it)
    u32 lag_units;            // >= max_blocks: single-wave order
    u32 group_units;
    u32 table_smem_offset;    // bytes from the aligned shared-memory base to the routing tables
    u32 withhold_block;       // tests only: this block's arrival is never published (~0u: off)
    u64* trace;               // profiling only: kTraceEvents %globaltimer stamps per block (null: off)
    // Across ranks (the expert-parallel instantiation only). Regions of the symmetric buffer
    // sit at the same offsets on every rank: a peer's is peer_bases[peer] + offset. The bank's
    // counts and cursors then count per global expert, this rank's pairs into its send list.
    const u64* peer_bases;    // [num_ranks]
    u64 off_x;                // [T, H] e4m3 inputs, staged by the host
    u64 off_x_sf;             // [T, H / 128] their scales
    u64 off_send_list;        // [T * K] (weight bits << 32) | (token * K + slot), grouped by expert
    u64 off_combine;          // [K, T, H] bf16 partials
    u64 off_ep_banks;         // words peers write, per launch parity (ep::EpBankLayout)
    u64* send_list;           // this rank's
    u32* ep_banks;            // this rank's
    ep::EpBankLayout ep_bank;
    u32 rank;
    u32 num_ranks;
};

// Events of the optional per-block trace (megamoe_rt.fused.TRACE_EVENTS names them).
enum TraceEvent : u32 {
    kTraceStart = 0, kTraceCounted, kTraceClaimed, kTraceDispatchDone, kTraceProducerDone, kTraceMathDone,
    kTraceAllTilesDone, kTraceCombineDone, kTraceEvents
};

}  // namespace megamoe_rt::fused
