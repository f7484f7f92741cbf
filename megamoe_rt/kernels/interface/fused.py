"""The fused MoE kernel (cuda_src/fused/): its parameters, tile, counter banks, trace events
and the shared-memory sizes the host reserves for it."""

from megamoe_rt.kernels.interface import gemm
from megamoe_rt.kernels.interface.decl import (
    U32,
    U64,
    Array,
    Comment,
    Constant,
    Enum,
    EnumValue,
    Field,
    Header,
    Ptr,
    Struct,
    Value,
    formula,
    packed_offsets,
)
from megamoe_rt.kernels.interface.ep import EP_BANK_LAYOUT
from megamoe_rt.kernels.interface.moe import MOE_PARAMS
from megamoe_rt.kernels.interface.stream import STREAMED_POOL
from megamoe_rt.kernels.interface.sync import GRID_BARRIER_WORDS, WAIT_CONTEXT

BLOCK_M = Constant("kBlockM", 64, doc="rows of a tile and of a pool block")
BLOCK_N = Constant("kBlockN", 256, doc="columns of a tile, split between the two math warpgroups")
NUM_THREADS = Constant("kNumThreads", 384, doc="one producer and two math warpgroups")
MAX_BLOCKS = Constant("kMaxBlocks", 1 << 24, hex=True, doc="pool blocks of a call: its rows stay within an i32")
NO_BLOCK = Constant("kNoBlock", 0xFFFFFFFF, hex=True, doc="FusedParams::withhold_block when off")
TILE_QUEUE_BYTES = Constant("kTileQueueBytes", 80, doc="TileQueue (fused/tile_queue.cuh) asserts it is this size")
REDUCE_THREADS = Constant("kReduceThreads", 256, doc="split K3 (split/split_reduce.cu): two tokens at a time")
RELAY_BYTES = Constant("kRelayBytes", 320, doc="SignalRelay (fused/signal_relay.cuh) asserts it is this size")

ROLE = Enum(
    "Role",
    [
        EnumValue("kFused", "fused", "the whole layer in one launch"),
        EnumValue("kSplitL1", "split_l1", "split K1: routing, dispatch, L1 + SwiGLU + requant"),
        EnumValue("kSplitL2", "split_l2", "split K2: L2 + scatter of the partials"),
        EnumValue("kStreamed", "streamed", "the whole layer on a streamed call's input ring (one rank)"),
    ],
    doc="What one launch of the fused kernel runs: the whole layer, one side of the split pipeline\n"
    "(K1 and K2 run concurrently in disjoint SM partitions; K3 is split/split_reduce.cu), or the\n"
    "whole layer consuming the input ring chunk by chunk (fused/streamed_call.cuh).",
)

TRACE_EVENT = Enum(
    "TraceEvent",
    [
        EnumValue("kTraceStart", "start"),
        EnumValue("kTraceCounted", "counted"),
        EnumValue("kTraceClaimed", "claimed"),
        EnumValue("kTraceDispatchDone", "dispatch_done"),
        EnumValue("kTraceProducerDone", "producer_done"),
        EnumValue("kTraceMathDone", "math_done"),
        EnumValue("kTraceAllTilesDone", "all_tiles_done"),
        EnumValue("kTraceCombineDone", "combine_done"),
        EnumValue("kTraceFirstL1", "first_l1", "the producer starts loading its first L1 tile"),
        EnumValue("kTraceLastChunk", "last_chunk", "streamed: the first dispatch warp sees the last chunk"),
        EnumValue("kTraceSm", "sm", "not a time: the SM the block ran on (%smid)"),
        EnumValue("kTraceWaitRowsNs", "wait_rows_ns", "ns the producer waited for an L1 block's rows"),
        EnumValue("kTraceWaitRingNs", "wait_ring_ns", "ns the producer waited for a ring slot's L2 tiles"),
        EnumValue("kTraceWaitL1OutNs", "wait_l1_out_ns", "ns the producer waited for an L2 block's L1 output"),
        EnumValue("kTraceWaitDispatchNs", "wait_dispatch_ns", "ns dispatch warps waited for ring blocks (summed)"),
    ],
    doc="Events of the optional per-block trace: FusedParams::trace holds kTraceEvents\n"
    "%globaltimer stamps per block, in this order (the host names them TRACE_EVENTS), then\n"
    "the block's SM, then the nanoseconds its warps spent in each kind of data wait.",
    scoped=False,
    count="kTraceEvents",
)

BANK_LAYOUT = Struct(
    "BankLayout",
    [
        Field("words", U32, "bank size in u32 words"),
        Field("counts", U32, "[num_local_experts] rows routed to each local expert"),
        Field("cursors", U32, "[num_local_experts] rows claimed so far"),
        Field("arrivals", U32, "[max_blocks] rows landed in each pool block (gates its L1 tiles)"),
        Field("l1_done", U32, "[max_blocks] L1 n-tiles published per block (gates L2, frees the pool slot)"),
        Field("l2_read", U32, "[max_blocks] L2 n-tiles done reading the block (frees the activation slot)"),
        Field("ticket", U32, "[1] next order position to hand out (fused/tile_queue.cuh)"),
        Field("l2_ticket", U32, "[1] split: K2's next position on the L2 stream"),
        Field("routing_published", U32, "[1] split: K1 laid out and claimed the pool: 1 | overflow << 1"),
        Field("reduce_exits", U32, "[1] split: K3 blocks past their read of the launch epoch"),
    ],
    doc="Per-launch counters, in one of two banks picked by the launch parity: a fused launch\n"
    "zeroes the other bank for the next one, so back-to-back launches need no memset and no\n"
    "extra barrier (the split graph's memset node zeroes both instead). Word offsets inside a\n"
    "bank, computed on the host.",
)


@formula(
    doc="u32 words of one counter bank: counts and cursors per expert, three per-block\n"
    "counters, the ticket and the split pipeline's three words (BankLayout on the host)."
)
def bank_words(num_experts: Value, max_blocks: Value) -> Value:
    return 2 * num_experts + 3 * max_blocks + 4


def bank_region_words(num_experts: int, max_blocks: int) -> dict[str, int]:
    """u32 words of each region of one counter bank, in :data:`BANK_LAYOUT`'s field order."""
    e, b = int(num_experts), int(max_blocks)
    return {
        "counts": e,
        "cursors": e,
        "arrivals": b,
        "l1_done": b,
        "l2_read": b,
        "ticket": 1,
        "l2_ticket": 1,
        "routing_published": 1,
        "reduce_exits": 1,
    }


def bank_offsets(num_experts: int, max_blocks: int) -> dict[str, int]:
    """The values of :data:`BANK_LAYOUT` for one bank (the host's ``BankLayout``): each region's
    first word, the regions packed in field order, and ``words``, which is :func:`bank_words`
    (what the buffer layout reserves per bank)."""
    out = packed_offsets(BANK_LAYOUT, bank_region_words(num_experts, max_blocks))
    words = bank_words(int(num_experts), int(max_blocks))
    if out["words"] != words:
        raise AssertionError(f"BankLayout: the regions take {out['words']} words, bank_words() reserves {words}")
    return out


@formula(
    doc="Shared memory of the GEMM carve-up (stages, epilogue scratch, barriers); the routing\n"
    "tables start there (FusedParams::table_smem_offset)."
)
def tile_smem_bytes(stages: Value) -> Value:
    return gemm.pipeline_smem_bytes(BLOCK_M, BLOCK_N, stages) - gemm.SMEM_ALIGN_SLACK


@formula(
    doc="The pool layout and unit table (fused/unit_table.cuh): scalars[4] | row_begin[E_local + 1] |\n"
    "row_end[E_local] | unit_begin[E_local + 1], 4 bytes each: sized by the experts, not the pool."
)
def unit_table_bytes(num_local_experts: Value) -> Value:
    return 4 * (2 * num_local_experts + 1) + 4 * 4 + 4 * (num_local_experts + 1)


@formula(doc="Shared memory of RoutingTables: the tile queue, the signal relay, then the unit table.")
def routing_table_bytes(num_local_experts: Value) -> Value:
    return unit_table_bytes(num_local_experts) + TILE_QUEUE_BYTES + RELAY_BYTES


@formula(
    doc="Across ranks, shared memory after the routing tables (EpScratch):\n"
    "send_offsets[E + 1] | totals[E_local] | src_rows[E_local][R + 1]."
)
def ep_scratch_bytes(num_experts: Value, num_local_experts: Value, num_ranks: Value) -> Value:
    return 4 * (num_experts + 1 + num_local_experts + num_local_experts * (num_ranks + 1))


FUSED_PARAMS = Struct(
    "FusedParams",
    [
        Field("moe", MOE_PARAMS, "inputs, pools (pool_rows = ring rows), per-row metadata (full size), combine, y"),
        Field("l1", gemm.GEMM_PARAMS, "n = 2I, k = H: the input pool against w1 (gate|up interleaved)"),
        Field("l1_out", gemm.SWIGLU_FP8_PARAMS, "into the activation ring; row_weight: full-size metadata"),
        Field("l2", gemm.GEMM_PARAMS, "n = H, k = I: the activation ring against w2"),
        Field("l2_out", gemm.SCATTER_BF16_PARAMS, "row_dst: full-size metadata"),
        Field("wait", WAIT_CONTEXT),
        Field("banks", Array(Ptr(U32), 2)),
        Field("bank", BANK_LAYOUT),
        Field("launch_epoch", Ptr(U32), "parity of this word picks the bank; bumped at the end of a launch"),
        Field("grid_barrier", Ptr(GRID_BARRIER_WORDS)),
        Field("ring_blocks", U32, "pool / activation slots of BLOCK_M rows"),
        Field("max_blocks", U32, "worst-case pool blocks of a call (counters and tables are sized for it)"),
        Field("lag_units", U32, ">= max_blocks: single-wave order; split: 0 (each kernel walks one layer)"),
        Field("group_units", U32),
        Field("table_smem_offset", U32, "bytes from the aligned shared-memory base to the routing tables"),
        Field(
            "withhold_block",
            U32,
            "tests only: this block's rows (fused) or L1 output (split K1) go unpublished (kNoBlock: off)",
        ),
        Field("trace", Ptr(U64), "profiling only: kTraceEvents %globaltimer stamps per block (null: off)"),
        Field("streamed", STREAMED_POOL, "Role::kStreamed only: the ring and the pool's claim state"),
        Comment(
            "Across ranks (the expert-parallel instantiation only). Regions of the symmetric buffer\n"
            "sit at the same offsets on every rank: a peer's is peer_bases[peer] + offset. The bank's\n"
            "counts and cursors then count per global expert, this rank's pairs into its send list."
        ),
        Field("peer_bases", Ptr(U64, const=True), "[num_ranks]"),
        Field("off_x", U64, "[T, H] e4m3 inputs, staged by the host"),
        Field("off_x_sf", U64, "[T, H / 128] their scales"),
        Field("off_send_list", U64, "[T * K] (weight bits << 32) | (token * K + slot), grouped by expert"),
        Field("off_combine", U64, "[K, T, H] bf16 partials"),
        Field("off_ep_banks", U64, "words peers write, per launch parity (ep::EpBankLayout)"),
        Field("send_list", Ptr(U64), "this rank's"),
        Field("ep_banks", Ptr(U32), "this rank's"),
        Field("ep_bank", EP_BANK_LAYOUT),
        Field("rank", U32),
        Field("num_ranks", U32),
    ],
    doc="Parameters of the fused MoE kernel; every pointer, stride and size is resolved on the host\n"
    "from the buffer layout.",
)

HEADER = Header(
    "fused",
    "megamoe_rt::fused",
    [
        BLOCK_M,
        BLOCK_N,
        NUM_THREADS,
        MAX_BLOCKS,
        NO_BLOCK,
        TILE_QUEUE_BYTES,
        RELAY_BYTES,
        REDUCE_THREADS,
        ROLE,
        TRACE_EVENT,
        BANK_LAYOUT,
        bank_words,
        tile_smem_bytes,
        unit_table_bytes,
        routing_table_bytes,
        ep_scratch_bytes,
        FUSED_PARAMS,
    ],
    doc="Parameters, tile, counter banks, trace events and shared-memory sizes of the fused MoE kernel.",
    module=__name__,
)
