"""Probe and synthetic workloads for partition experiments (cuda_src/probe/)."""

from megamoe_rt.kernels.interface.decl import I32, U32, U64, Field, Header, Opaque, Ptr, Struct
from megamoe_rt.kernels.interface.stream import READY_BLOCKS
from megamoe_rt.kernels.interface.sync import WAIT_CONTEXT

_U32X4 = Opaque("ptx::u32x4", include="ptx/ld_st.cuh")

SM_PROBE_PARAMS = Struct(
    "SmProbeParams",
    [
        Field("smid", Ptr(U32), "[grid]"),
        Field("start_ns", Ptr(U64), "[grid]"),
        Field("end_ns", Ptr(U64), "[grid]"),
        Field("spin_ns", U64),
    ],
    doc="sm_probe: each block records its SM and %globaltimer at start and end.",
)

STREAM_COPY_PARAMS = Struct(
    "StreamCopyParams",
    [
        Field("src", Ptr(_U32X4, const=True)),
        Field("dst", Ptr(_U32X4)),
        Field("n16", U64, "16-byte words to copy"),
    ],
    doc="stream_copy: a memory-bound workload.",
)

STREAM_ORDER_PROBE_PARAMS = Struct(
    "StreamOrderProbeParams",
    [
        Field("expert_of_pair", Ptr(I32, const=True), "[num_pairs] local expert of each pair, -1 = not here"),
        Field("publish_ns", Ptr(U64, const=True), "[num_chunks] when chunk c counts as published, after launch"),
        Field("expert_counts", Ptr(U32), "[num_experts] rows reserved per expert (zeroed)"),
        Field("blocks_claimed", Ptr(U32), "pool blocks opened (zeroed)"),
        Field("expert_blocks", Ptr(U32), "[num_experts, blocks_per_expert] pool block + 1 of each (zeroed)"),
        Field("ready", READY_BLOCKS, "(zeroed)"),
        Field("parts_reserved", Ptr(U32), "dispatch warps through a chunk's reservations (zeroed)"),
        Field("ticket", Ptr(U32), "the launch-wide ticket counter (zeroed)"),
        Field("l1_done", Ptr(U32), "[max_blocks] L1 tiles done per position (zeroed)"),
        Field("pool_pair", Ptr(I32), "[max_blocks * block_rows] the pair in each pool row"),
        Field("task_log", Ptr(U32), "[capacity, 4] per ticket: l2, position, tile, block"),
        Field("checks", Ptr(U32), "[4] L1 before its block was complete, L2 before its L1, tickets past capacity"),
        Field("times_ns", Ptr(U64), "[2] earliest L1 task start (init ~0), latest chunk publication (init 0)"),
        Field("wait", WAIT_CONTEXT),
        Field("num_pairs", U32),
        Field("pairs_per_chunk", U32),
        Field("num_chunks", U32),
        Field("num_experts", U32),
        Field("block_rows", U32, "rows of a pool block, at most 128"),
        Field("blocks_per_expert", U32),
        Field("lag", U32),
        Field("l1_tiles", U32),
        Field("l2_tiles", U32),
        Field("capacity", U32, "task_log rows"),
    ],
    doc="stream_order_walker: a streamed call's reservations, ready list and ticket order, without GEMMs.",
)

HEADER = Header(
    "probe",
    "megamoe_rt::probe",
    [SM_PROBE_PARAMS, STREAM_COPY_PARAMS, STREAM_ORDER_PROBE_PARAMS],
    doc="Parameters of the probe kernels.",
    module=__name__,
)
