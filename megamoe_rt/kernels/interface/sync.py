"""Deadline-bounded waits and the record a timed-out wait leaves (cuda_src/sync/)."""

from megamoe_rt.kernels.interface.decl import (
    U32,
    U64,
    Comment,
    Constant,
    Enum,
    EnumValue,
    Field,
    Header,
    Ptr,
    Struct,
)

WAIT_SITE = Enum(
    "WaitSite",
    [
        EnumValue("kTest", "test", "tests withholding a signal on purpose", "test signal"),
        EnumValue(
            "kExpertCountsArrived",
            "expert_counts_arrived",
            "all ranks' per-expert counts have landed",
            "expert counts from all ranks",
        ),
        EnumValue(
            "kDispatchDone", "dispatch_done", "every peer finished pulling from this rank", "dispatch done on all peers"
        ),
        EnumValue(
            "kCombineArrived",
            "combine_arrived",
            "every peer finished scattering into this rank's combine buffer",
            "combine partials from all peers",
        ),
        EnumValue(
            "kL1RowsArrived",
            "l1_rows_arrived",
            "fused: a pool block's rows have arrived (L1 may start)",
            "L1 rows arrived",
        ),
        EnumValue(
            "kL1OutputPublished",
            "l1_output_published",
            "fused: a block's L1 output is published (L2 may start)",
            "L1 output published",
        ),
        EnumValue(
            "kRingSlotFree",
            "ring_slot_free",
            "fused: a ring slot's L2 reads are done (L1 may overwrite; peer: the block that waits,\n"
            "its slot's previous block is peer - ring_blocks)",
            "ring slot free",
        ),
        EnumValue(
            "kStreamRouteReady",
            "stream_route_ready",
            "streaming: a chunk's routing half (topk_idx, topk_weights) is published (peer: the ring slot)",
            "stream route ready",
        ),
        EnumValue(
            "kGridBarrier",
            "grid_barrier",
            "fused: every block of the grid reached the same phase (peer: this block's arrival number,\n"
            "expected: the grid's blocks, seen: the barrier's generation word)",
            "grid barrier",
        ),
        EnumValue(
            "kPoolSlotFree",
            "pool_slot_free",
            "fused: a pool slot's L1 reads are done (dispatch may refill it; peer: the block that waits,\n"
            "its slot's previous block is peer - ring_blocks)",
            "pool slot free",
        ),
        EnumValue(
            "kRingOverflow",
            "ring_overflow",
            "fused: a single-wave call needs more pool blocks than the ring holds",
            "single-wave pool fits the ring",
        ),
        EnumValue(
            "kSplitRoutingPublished",
            "split_routing_published",
            "split: K1 has laid out and claimed the pool (K2 may build its tables)",
            "split routing published",
        ),
        EnumValue(
            "kStreamSlotFree",
            "stream_slot_free",
            "streaming: every consumer is done with the slot's last chunk (peer: the ring slot)",
            "stream slot free",
        ),
        EnumValue(
            "kStreamPoolBlockClaimed",
            "stream_pool_block_claimed",
            "streaming: the pool block a row falls in has been claimed for its expert (peer: the expert)",
            "stream pool block claimed",
        ),
        EnumValue(
            "kStreamLayoutReady",
            "stream_layout_ready",
            "streaming: a chunk's activation half (x, x_sf) is published (peer: the ring slot)",
            "stream layout ready",
        ),
        EnumValue(
            "kSmemStageFull",
            "smem_stage_full",
            "gemm: a shared-memory pipeline stage's TMA loads have landed (peer: the stage,\n"
            "expected: the phase parity)",
            "shared-memory stage loaded",
        ),
        EnumValue(
            "kSmemStageFree",
            "smem_stage_free",
            "gemm: the math warpgroups released a shared-memory stage (peer: the stage, expected: the parity)",
            "shared-memory stage released",
        ),
        EnumValue(
            "kTileTicket",
            "tile_ticket",
            "fused: the producer's next tile ticket, or a free ticket slot (peer: the queue slot)",
            "tile ticket handed over",
        ),
        EnumValue(
            "kRelayPost",
            "relay_post",
            "fused: a tile completion posted to the relay thread, or a free relay slot (peer: the slot)",
            "signal relay post",
        ),
        EnumValue(
            "kStreamBlockReady",
            "stream_block_ready",
            "streaming: the pool block at a ready-list position is complete, or the seal says the call\n"
            "has no such position (peer: the position)",
            "stream block ready",
        ),
    ],
    doc="Where a wait happens. Its message names it in the device's report and in the host's\n"
    "exception (megamoe_rt.runtime.deadlines.WAIT_SITES).",
    count="kCount",
    message_fn="wait_site_name",
    default_message="unknown wait",
)

RECORD_EMPTY = Constant("kRecordEmpty", 0, doc="TimeoutRecord::state: nothing recorded")
RECORD_WRITING = Constant("kRecordWriting", 1, doc="TimeoutRecord::state: the first timed-out thread is writing it")
RECORD_COMPLETE = Constant("kRecordComplete", 2, doc="TimeoutRecord::state: complete, the host may read it")

TIMEOUT_RECORD = Struct(
    "TimeoutRecord",
    [
        Field("state", U32, "kRecordEmpty, kRecordWriting, kRecordComplete (the first timed-out thread wins)"),
        Field("site", U32, "WaitSite"),
        Field("block", U32),
        Field("thread", U32),
        Field("rank", U32),
        Field("peer", U32),
        Field("expected", U64),
        Field("seen", U64),
        Field("elapsed_ns", U64),
    ],
    doc="What a timed-out wait leaves in mapped pinned host memory before it traps, so the host\n"
    "can name the wait even after the trap has made the context unusable.",
)

WAIT_CONTEXT = Struct(
    "WaitContext",
    [
        Field("timeout_ns", U64, "from the host (MEGAMOE_RT_TIMEOUT_S, default 60 s)"),
        Field("record", Ptr(TIMEOUT_RECORD), "mapped host memory, may be null"),
        Field("rank", U32),
        Field("pad_", U32),
    ],
    doc="What every deadline-bounded wait gets.",
)

GRID_BARRIER_WORDS = Struct(
    "GridBarrierWords",
    [
        Comment("Sense-reversing: the last block to arrive resets the count and bumps the generation."),
        Field("count", U32),
        Field("generation", U32),
    ],
    doc="The words of a grid-wide barrier (sync/grid_barrier.cuh), in the buffer's grid_sync region.",
)

HEADER = Header(
    "sync",
    "megamoe_rt::sync",
    [
        WAIT_SITE,
        RECORD_EMPTY,
        RECORD_WRITING,
        RECORD_COMPLETE,
        TIMEOUT_RECORD,
        WAIT_CONTEXT,
        GRID_BARRIER_WORDS,
    ],
    doc="Waits with a deadline: where they happen, what they get and what a timed-out one leaves.",
    module=__name__,
)
