"""The chunk-ready input ring (cuda_src/stream/): its descriptor, shared by the producer header
users include in their own kernels, the host-side chunk writer and the layer's consumer."""

from megamoe_rt.kernels.interface.decl import F32, I32, U8, U32, U64, VOID, Constant, Field, Header, Ptr, Struct
from megamoe_rt.kernels.interface.sync import WAIT_CONTEXT

EPOCH_SHIFT = Constant(
    "kEpochShift", 32, doc="a generation is (epoch << kEpochShift) | (chunk + 1): epoch in the high half"
)

STREAM_RING = Struct(
    "StreamRing",
    [
        Field("x", Ptr(U8), "[num_slots, tokens_per_slot, hidden] e4m3"),
        Field("x_sf", Ptr(F32), "[num_slots, tokens_per_slot, hidden / 128]"),
        Field("topk_idx", Ptr(I32), "[num_slots, tokens_per_slot, num_topk] global expert ids, -1 = empty"),
        Field("topk_weights", Ptr(F32), "[num_slots, tokens_per_slot, num_topk]"),
        Field("route_ready_gen", Ptr(U64), "[num_slots] generation whose topk_idx / topk_weights are in the slot"),
        Field("layout_ready_gen", Ptr(U64), "[num_slots] generation whose x / x_sf are in the slot"),
        Field("consumed_gen", Ptr(U64), "[num_slots] generation every consumer is done with"),
        Field("producer_epoch", Ptr(U32), "calls the producer side has begun (stream_begin_call)"),
        Field("consumer_epoch", Ptr(U32), "calls the layer has begun"),
        Field("num_slots", U32),
        Field("tokens_per_slot", U32),
        Field("hidden", U32),
        Field("num_topk", U32),
    ],
    doc="One rank's ring of num_slots slots of tokens_per_slot tokens. Chunk c of a call lives in\n"
    "slot c % num_slots and holds the call's tokens [c * tokens_per_slot, ...). Addresses are\n"
    "this rank's (megamoe_rt.kernels.stream.InputRing resolves them from the layer's buffer).",
)

RING_CHUNK_PARAMS = Struct(
    "RingChunkParams",
    [
        Field("ring", STREAM_RING),
        Field("x", Ptr(U8, const=True), "the call's [num_tokens, hidden] e4m3"),
        Field("x_sf", Ptr(F32, const=True), "[num_tokens, hidden / 128]"),
        Field("topk_idx", Ptr(VOID, const=True), "[num_tokens, num_topk] int32 or int64 (topk_idx_bytes)"),
        Field("topk_weights", Ptr(F32, const=True), "[num_tokens, num_topk]"),
        Field("wait", WAIT_CONTEXT, "the deadline of the wait for a free slot"),
        Field("chunk", U32),
        Field("num_tokens", U32, "tokens of the whole call (the last chunk may be partial)"),
        Field("topk_idx_bytes", U32, "4 or 8: the width of the call's expert ids (the slot holds int32)"),
    ],
    doc="The ring's kernels (cuda_src/stream/chunk_ring.cu): the host-side chunk writer's (one chunk\n"
    "of a call's inputs copied into its slot and published) and the layer's (wait for a chunk,\n"
    "release its slot); the consumer's leave the input pointers null.",
)

READY_BLOCKS = Struct(
    "ReadyBlocks",
    [
        Field("state", Ptr(U32), "[max_blocks] rows written (low 16 bits) + size << 16, 0 until the size is known"),
        Field("ready", Ptr(U32), "[max_blocks] the block + 1 at each ready-list position, 0 until appended"),
        Field("ready_count", Ptr(U32), "positions handed out"),
        Field("sealed", Ptr(U32), "0 until the seal, then the call's positions (its blocks) + 1"),
        Field("capacity", U32, "positions the list holds (max_blocks): a position past them never exists"),
    ],
    doc="A streamed call's pool blocks in the order they complete (stream/ready_blocks.cuh); every\n"
    "word zero before the call.",
)

STREAMED_POOL = Struct(
    "StreamedPool",
    [
        Field("ring", STREAM_RING),
        Field("ready", READY_BLOCKS),
        Field("expert_counts", Ptr(U32), "[num_local_experts] rows reserved so far"),
        Field("expert_blocks", Ptr(U32), "[num_local_experts, blocks_per_expert] pool block + 1, 0 until opened"),
        Field("blocks_claimed", Ptr(U32), "pool blocks opened so far"),
        Field("block_expert", Ptr(U32), "[max_blocks] the local expert of each opened block"),
        Field("slot_done", Ptr(U32), "[num_slots] dispatch warps through each slot so far"),
        Field("parts_done", Ptr(U32), "(chunk, dispatch warp) parts reserved so far; the last one seals"),
        Field("call_topk_idx", Ptr(I32), "[T, K] the call's expert ids, kept for the combine"),
        Field("blocks_per_expert", U32),
        Field("num_chunks", U32, "chunks of the call"),
        Field("lag", U32, "the task order's lag in ready-list positions (fused/stream_order.cuh)"),
    ],
    doc="A streamed call consumed by the fused kernel (Role::kStreamed): its input ring, the pool\n"
    "blocks it opens as chunks arrive, handed to the GEMMs as they complete; every word zero\n"
    "before the call but the ring's.",
)

HEADER = Header(
    "stream",
    "megamoe_rt::stream",
    [EPOCH_SHIFT, STREAM_RING, RING_CHUNK_PARAMS, READY_BLOCKS, STREAMED_POOL],
    doc="The chunk-ready input ring's descriptor and its kernels' parameters.",
    module=__name__,
)
