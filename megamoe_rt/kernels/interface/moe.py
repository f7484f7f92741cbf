"""Routing, dispatch and combine of the unfused layer (cuda_src/moe/), also embedded in the
fused and expert-parallel parameters."""

from megamoe_rt.kernels.interface.decl import (
    F32,
    I32,
    U8,
    U16,
    U32,
    U64,
    VOID,
    Constant,
    Field,
    Header,
    Ptr,
    Struct,
)
from megamoe_rt.kernels.interface.errors import ERROR_REPORT
from megamoe_rt.kernels.interface.stream import STREAM_RING
from megamoe_rt.kernels.interface.sync import WAIT_CONTEXT

MAX_LOCAL_EXPERTS = Constant(
    "kMaxLocalExperts", 1024, doc="the count kernel's shared histogram and the one-block scan hold one entry each"
)
MAX_TOPK = Constant("kMaxTopk", 32, doc="a slot mask holds one bit per top-k slot")
COUNT_THREADS = Constant("kCountThreads", 256)
SCAN_THREADS = Constant("kScanThreads", 1024, doc="one block scans every local expert")
DISPATCH_THREADS = Constant("kDispatchThreads", 256)
COMBINE_THREADS = Constant("kCombineThreads", 128)

MOE_PARAMS = Struct(
    "MoeParams",
    [
        Field(
            "topk_idx", Ptr(VOID, const=True), "[num_tokens, num_topk], int32 or int64 global expert ids, -1 = empty"
        ),
        Field("topk_weights", Ptr(F32, const=True), "[num_tokens, num_topk]"),
        Field("x", Ptr(U8, const=True), "[num_tokens, hidden] e4m3"),
        Field("x_sf", Ptr(F32, const=True), "[num_tokens, hidden / 128]"),
        Field("num_tokens", U32),
        Field("num_topk", U32),
        Field("hidden", U32),
        Field("num_experts", U32, "global"),
        Field("num_local_experts", U32),
        Field("first_local_expert", U32, "global id of local expert 0"),
        Field(
            "pool_rows",
            U32,
            "rows of the pool's data regions (pool, pool_sf): the ring's slots when the pool is a ring",
        ),
        Field("pool_align", U32, "each expert's rows start on a multiple of this"),
        Field("token_capacity", U32, "T of the combine buffer [K, T, hidden]"),
        Field(
            "row_base",
            U32,
            "unfused ring: first pool row of this cycle's window (pool row r lives in data row\n"
            "r - row_base); 0 otherwise",
        ),
        Field("expert_counts", Ptr(I32), "[num_local_experts]"),
        Field("expert_offsets", Ptr(I32), "[num_local_experts + 1]"),
        Field("expert_cursors", Ptr(I32), "[num_local_experts]"),
        Field("expert_recv_stats", Ptr(I32), "optional [num_local_experts], += counts every call"),
        Field("errors", Ptr(ERROR_REPORT), "mapped host memory the call reports refused inputs into"),
        Field("pool", Ptr(U8), "[pool_rows, hidden] e4m3"),
        Field("pool_sf", Ptr(F32), "[hidden / 128, pool_rows]"),
        Field("pool_src", Ptr(I32), "[pool_row_limit]: token * num_topk + slot"),
        Field("pool_weight", Ptr(F32), "[pool_row_limit]"),
        Field("pool_dst", Ptr(U64), "[pool_row_limit]: byte address of the row's combine slot"),
        Field("combine", Ptr(U8), "[num_topk, token_capacity, hidden] bf16"),
        Field("y", Ptr(U16), "[num_tokens, hidden] bf16 bits"),
        Field(
            "pool_cycles", Ptr(U32), "unfused: the call's pool cycles, ceil(rows laid out / pool_rows) (max over ranks)"
        ),
        Field(
            "pool_row_limit", U32, "rows the routing may lay out: the worst-case pool, the size of the per-row metadata"
        ),
        Field(
            "token_base",
            U32,
            "streamed calls: the call's index of token 0 here (a chunk's first token), so pool rows,\n"
            "combine slots and reports name the call's tokens; 0 otherwise",
        ),
    ],
    doc="The routing, dispatch and combine kernels' view of one MoE layer call. Every pointer and\n"
    "stride is resolved on the host from the buffer layout (megamoe_rt/schedule/layout.py).",
)

STREAM_POOL_PARAMS = Struct(
    "StreamPoolParams",
    [
        Field(
            "moe",
            MOE_PARAMS,
            "the chunk as a call of its own: its slot's inputs, num_tokens its tokens, token_base its\n"
            "first token; the expert counts are the call's, growing chunk by chunk",
        ),
        Field(
            "expert_blocks",
            Ptr(I32),
            "[num_local_experts, blocks_per_expert]: 1 + the pool block holding rows\n"
            "[j * pool_align, (j + 1) * pool_align) of each expert, 0 until claimed (0xFFFFFFFF: the pool was full)",
        ),
        Field("blocks_claimed", Ptr(U32), "pool blocks handed out so far in the call"),
        Field(
            "block_map", Ptr(I32), "[pool_blocks]: where each block of the sealed layout lives (GemmParams::block_map)"
        ),
        Field(
            "call_topk_idx",
            Ptr(I32),
            "[token_capacity, num_topk]: the call's expert ids, for the combine after slots are reused",
        ),
        Field("wait", WAIT_CONTEXT, "the deadline of a row's wait for its block to be claimed"),
        Field("blocks_per_expert", U32, "the most pool blocks one local expert can take in a call"),
        Field("pool_blocks", U32, "pool blocks in the data regions"),
    ],
    doc="A streamed call's one pool (cuda_src/moe/stream_pool.cu): chunks claim rows of their\n"
    "experts as they arrive, a block at a time, then the seal lays the experts out over the blocks.",
)

STREAM_CONSUME_PARAMS = Struct(
    "StreamConsumeParams",
    [
        Field(
            "pool",
            STREAM_POOL_PARAMS,
            "the call's pool; pool.moe is the call (num_tokens: the call's tokens), each chunk's inputs\n"
            "come from its ring slot",
        ),
        Field("ring", STREAM_RING, "this rank's input ring"),
        Field("slot_done", Ptr(U32), "[num_slots]: blocks done with each slot in the call (zeroed per call)"),
        Field("num_chunks", U32, "chunks of the call (the same on every rank: from num_tokens_bound)"),
        Field(
            "chunk_groups",
            U32,
            "chunks consumed at once: block b takes the chunks c with c % chunk_groups == b % chunk_groups\n"
            "(the grid is a multiple of it)",
        ),
    ],
    doc="One launch that walks every chunk of a streamed call (cuda_src/moe/stream_pool.cu): each\n"
    "group of blocks waits for its chunks, claims and copies them, and the last block done with a\n"
    "chunk releases its slot.",
)

HEADER = Header(
    "moe",
    "megamoe_rt::moe",
    [
        MAX_LOCAL_EXPERTS,
        MAX_TOPK,
        COUNT_THREADS,
        SCAN_THREADS,
        DISPATCH_THREADS,
        COMBINE_THREADS,
        MOE_PARAMS,
        STREAM_POOL_PARAMS,
        STREAM_CONSUME_PARAMS,
    ],
    doc="Parameters and limits of the routing, dispatch and combine kernels.",
    module=__name__,
)
