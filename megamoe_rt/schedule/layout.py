"""Byte layout of the symmetric buffer every rank allocates.

This module is the only place region offsets are computed. Kernels receive
them through their parameter struct and host code looks them up by name, so
the layout can change without touching either side.

All ranks must compute the same layout (remote writes address a peer's buffer
with the local offsets), which is why it depends only on the shape arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megamoe_rt.kernels.interface import ep as ep_interface
from megamoe_rt.kernels.interface import fused as fused_interface
from megamoe_rt.runtime import args
from megamoe_rt.schedule.arith import align_up, ceil_div
from megamoe_rt.schedule.plan import (
    BLOCK_M_CHOICES,
    align_tokens,
    check_expert_split,
    checked_pool_blocks,
    fused_schedule,
    pool_blocks_upper_bound,
)

__all__ = [
    "DTYPE_SIZES",
    "REGION_ALIGN",
    "WORKSPACE_ALIGN",
    "BufferLayout",
    "Region",
    "check_channels",
    "symm_buffer_layout",
]

# TMA needs 16-byte aligned bases; 1024 also keeps 128B-swizzle atoms (8 rows
# of 128 bytes) aligned so a region can be used as a swizzled TMA source.
REGION_ALIGN = 1024
# Counters and flags are touched by atomics and vector loads only; 128 bytes
# keeps each array on its own cache line without wasting whole kilobytes.
WORKSPACE_ALIGN = 128

DTYPE_SIZES: dict[str, int] = {
    "e4m3": 1,
    "uint8": 1,
    "bf16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "uint64": 8,
}

_SF_BLOCK = 128  # L1 activation scales are always per 128 channels
_ACT_SF_GRAN_CHOICES = (64, 128)
_POOL_CHOICES = ("full", "ring")
_GRID_SYNC_WORDS = 32
_PARITY_BANKS = 2  # counters and signal words peers write: one bank per launch parity


def ep_bank_words(num_ranks: int, num_local_experts: int) -> int:
    """u32 words of one bank of ``ep_banks`` (EpBankLayout, megamoe_rt.kernels.interface.ep)."""
    return int(ep_interface.bank_words(num_ranks, num_local_experts))


@dataclass(frozen=True)
class Region:
    """A named, typed slice ``[offset, offset + nbytes)`` of a buffer."""

    name: str
    offset: int
    nbytes: int
    align: int
    dtype: str
    shape: tuple[int, ...]
    doc: str

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BufferLayout:
    """The symmetric buffer's regions and the shape they were computed for.

    ``num_max_tokens_per_rank`` is the aligned capacity ``T``; ``pool_rows`` is
    ``pool_blocks * block_m``. ``workspace`` holds the workspace's sub-regions
    with offsets relative to the start of the ``workspace`` region.
    """

    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    num_max_tokens_per_rank: int
    num_ranks: int
    num_local_experts: int
    block_m: int
    act_sf_gran: int
    pool: str
    pool_blocks: int
    pool_rows: int
    regions: tuple[Region, ...]
    workspace: tuple[Region, ...]
    total_bytes: int
    stream_slots: int = 0  # the chunk-ready input ring: slots per rank (0: none)
    stream_tokens: int = 0  # tokens per slot

    @property
    def full_pool_blocks(self) -> int:
        """Blocks of the worst-case pool (what ``pool='full'`` reserves, and the rows the per-row
        metadata is sized for)."""
        return pool_blocks_upper_bound(
            self.num_max_tokens_per_rank, self.num_ranks, self.num_topk, self.num_local_experts, self.block_m
        )

    @property
    def full_pool_rows(self) -> int:
        return self.full_pool_blocks * self.block_m

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise ValueError(f"name={name!r}: expected one of {', '.join(r.name for r in self.regions)}")

    def workspace_region(self, name: str) -> Region:
        for r in self.workspace:
            if r.name == name:
                return r
        raise ValueError(f"name={name!r}: expected one of {', '.join(r.name for r in self.workspace)}")

    def offsets(self) -> dict[str, int]:
        """Absolute byte offset of every top-level region."""
        return {r.name: r.offset for r in self.regions}

    def workspace_offsets(self) -> dict[str, int]:
        """Byte offset of every workspace sub-region, relative to the workspace."""
        return {r.name: r.offset for r in self.workspace}

    def report(self) -> list[tuple[str, int, float]]:
        """``(name, bytes, MiB)`` for each top-level region, in buffer order."""
        return [(r.name, r.nbytes, r.nbytes / 2**20) for r in self.regions]

    def format_report(self) -> str:
        """Human-readable table of regions (workspace parts indented) and the total."""
        rows: list[tuple[str, str, str, str]] = []
        for r in self.regions:
            rows.append((r.name, f"{r.offset:,}", f"{r.nbytes:,}", f"{r.nbytes / 2**20:.2f}"))
            if r.name == "workspace":
                for w in self.workspace:
                    rows.append(
                        (
                            "  " + w.name,
                            f"+{w.offset:,}",
                            f"{w.nbytes:,}",
                            f"{w.nbytes / 2**20:.2f}",
                        )
                    )
        total = ("total", "", f"{self.total_bytes:,}", f"{self.total_bytes / 2**20:.2f}")
        header = ("region", "offset", "bytes", "MiB")
        w0 = max(len(x[0]) for x in (header, total, *rows))
        widths = [max(len(x[i]) for x in (header, total, *rows)) for i in range(1, 4)]

        def fmt(row: tuple[str, str, str, str]) -> str:
            return "  ".join([row[0].ljust(w0)] + [c.rjust(w) for c, w in zip(row[1:], widths)])

        title = (
            f"symmetric buffer: hidden={self.hidden} intermediate={self.intermediate} "
            f"experts={self.num_experts} (local {self.num_local_experts}) "
            f"topk={self.num_topk} T={self.num_max_tokens_per_rank} "
            f"ranks={self.num_ranks} pool={self.pool} blocks={self.pool_blocks}x{self.block_m}"
        )
        rule = "-" * len(fmt(header))
        lines = [title, fmt(header), rule, *map(fmt, rows), rule, fmt(total)]
        return "\n".join(lines)


class _Packer:
    """Lays regions out back to back, each start aligned to ``align``."""

    def __init__(self, align: int) -> None:
        self.align = align
        self.cursor = 0
        self.regions: list[Region] = []

    def add(self, name: str, dtype: str, shape: tuple[int, ...], doc: str) -> None:
        offset = align_up(self.cursor, self.align)
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        self.regions.append(Region(name, offset, nbytes, self.align, dtype, shape, doc))
        self.cursor = offset + nbytes


def check_channels(hidden: object, intermediate: object) -> tuple[int, int]:
    """``(hidden, intermediate)`` as ints, each a positive multiple of the 128 channels an
    activation scale covers: the one check of it, for the layout and the layer."""
    h = args.integer("hidden", hidden, minimum=1)
    i = args.integer("intermediate", intermediate, minimum=1)
    if h % _SF_BLOCK:
        raise ValueError(f"hidden={h}: expected a positive multiple of {_SF_BLOCK}")
    if i % _SF_BLOCK:
        raise ValueError(f"intermediate={i}: expected a positive multiple of {_SF_BLOCK}")
    return h, i


def stream_blocks_per_expert(num_max_tokens_per_rank: int, num_ranks: int, block_m: int) -> int:
    """The most pool blocks one local expert can take in a streamed call: a token routes to an
    expert at most once (repeated ids are refused), so at most every token of every rank."""
    return ceil_div(num_max_tokens_per_rank * num_ranks, block_m)


def streamed_claim_words(
    num_local_experts: int, blocks_per_expert: int, num_slots: int, pool_blocks: int
) -> dict[str, int]:
    """u32 words of each part of a fused streamed call's claim state (``stream_claim_words``,
    zeroed before every call), in the region's order: rows reserved per expert, each expert's
    blocks, blocks opened, dispatch warps through each slot, chunk parts reserved, then the
    ready list's block words, positions, count and seal (kernels' ``StreamedPool``)."""
    return {
        "expert_counts": num_local_experts,
        "expert_blocks": num_local_experts * blocks_per_expert,
        "blocks_claimed": 1,
        "slot_done": num_slots,
        "parts_done": 1,
        "state": pool_blocks,
        "ready": pool_blocks,
        "ready_count": 1,
        "sealed": 1,
    }


def streamed_claim_offsets(
    num_local_experts: int, blocks_per_expert: int, num_slots: int, pool_blocks: int
) -> dict[str, int]:
    """The first word of each part of :func:`streamed_claim_words`."""
    out, at = {}, 0
    for name, words in streamed_claim_words(num_local_experts, blocks_per_expert, num_slots, pool_blocks).items():
        out[name] = at
        at += words
    return out


def symm_buffer_layout(
    hidden: int,
    intermediate: int,
    num_experts: int,
    num_topk: int,
    num_max_tokens_per_rank: int,
    num_ranks: int = 1,
    *,
    block_m: int = 128,
    act_sf_gran: int = 128,
    pool: str = "full",
    ring_blocks: int | None = None,
    num_tokens_bound: int | None = None,
    stream_slots: int = 0,
    stream_tokens: int = 0,
    ep_staging: bool = False,
) -> BufferLayout:
    """Compute the symmetric buffer layout for one MoE shape.

    ``pool='full'`` sizes the expert pools for the worst-case routing at
    ``num_max_tokens_per_rank``; ``pool='ring'`` sizes them for the fused
    schedule's live window (``ring_blocks`` if given, else the schedule for
    ``num_tokens_bound``, default the capacity), never more than the full pool.
    ``stream_slots`` / ``stream_tokens``: the chunk-ready input ring (none when 0).
    ``ep_staging``: rows where the L2 epilogue leaves the partials owed to other ranks until
    they are put (the NVSHMEM transport across ranks; with peer pointers it stores them into
    the peers' combine buffers directly).
    """
    h, i = check_channels(hidden, intermediate)
    e, k, r = check_expert_split(num_experts, num_topk, num_ranks)
    t = align_tokens(args.integer("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=1))
    block_m = args.integer_choice("block_m", block_m, BLOCK_M_CHOICES)
    act_sf_gran = args.integer_choice("act_sf_gran", act_sf_gran, _ACT_SF_GRAN_CHOICES)
    if not isinstance(pool, str) or pool not in _POOL_CHOICES:
        raise ValueError(f"pool={pool!r}: expected one of {_POOL_CHOICES}")
    stream_slots = args.integer("stream_slots", stream_slots, minimum=0)
    stream_tokens = args.integer("stream_tokens", stream_tokens, minimum=0)
    el = e // r

    bound = t
    if num_tokens_bound is not None:
        bound = args.integer("num_tokens_bound", num_tokens_bound, minimum=1)
        if bound > t:
            raise ValueError(f"num_tokens_bound={bound}: expected at most the token capacity {t}")

    full_blocks = checked_pool_blocks(t, r, k, el, block_m)
    if pool == "full":
        if ring_blocks is not None:
            raise ValueError(f"ring_blocks={ring_blocks!r}: expected None when pool='full'")
        pool_blocks = full_blocks
    else:
        if ring_blocks is not None:
            ring = args.integer("ring_blocks", ring_blocks, minimum=1)
        else:
            ring = fused_schedule(bound, r, k, e, block_m).ring_blocks
        # A ring larger than the worst-case pool would only waste memory.
        pool_blocks = min(ring, full_blocks)
    rows = pool_blocks * block_m
    # Per-row metadata is indexed by the global pool row (a ring reuses data slots, not rows):
    # it stays sized for the worst-case pool, 16 bytes a row.
    meta_rows = full_blocks * block_m

    # Workspace first: its size is part of the top-level layout.
    ws = _Packer(WORKSPACE_ALIGN)
    ws.add("expert_recv_counts", "int32", (r, el), "rows each source rank sends to each local expert")
    ws.add(
        "expert_pool_offsets",
        "int32",
        (el + 1,),
        "first pool row of each local expert (block-aligned prefix sum, last = total rows)",
    )
    ws.add("expert_cursors", "int32", (el,), "rows placed so far per local expert while dispatching")
    ws.add(
        "pool_cycles",
        "uint32",
        (1,),
        "unfused: pool cycles of the last call that launched (across ranks the most of any rank)",
    )
    ws.add("grid_sync", "uint32", (_GRID_SYNC_WORDS,), "grid-wide barrier counters")
    ws.add(
        "fused_banks",
        "uint32",
        (_PARITY_BANKS, fused_interface.bank_words(e, full_blocks)),
        "fused kernel, per launch parity: expert counts and cursors, per-block arrivals, "
        "L1 publishes and L2 reads, the tile ticket",
    )
    ws.add(
        "launch_epoch",
        "uint32",
        (_GRID_SYNC_WORDS,),
        "launches so far; the parity picks the fused kernel's counter bank",
    )
    streaming = stream_slots > 0
    if streaming:
        sl = args.integer("stream_slots", stream_slots, minimum=1)
        args.integer("stream_tokens", stream_tokens, minimum=1)
        ws.add("stream_route_ready_gen", "uint64", (sl,), "generation whose routing is in each ring slot")
        ws.add("stream_layout_ready_gen", "uint64", (sl,), "generation whose x / x_sf are in each ring slot")
        ws.add("stream_consumed_gen", "uint64", (sl,), "generation every consumer is done with, per slot")
        ws.add("stream_epochs", "uint32", (2,), "calls begun by the producer side, by the layer")
        # A streamed call's one pool (one rank): blocks claimed as chunks arrive, laid out at the seal.
        ws.add("stream_blocks_claimed", "uint32", (1,), "streamed call: pool blocks claimed so far")
        ws.add("stream_slot_done", "uint32", (sl,), "streamed call: consumer blocks done with each slot so far")
        ws.add(
            "stream_expert_blocks",
            "int32",
            (el, stream_blocks_per_expert(t, r, block_m)),
            "streamed call: 1 + the pool block of each local expert's j-th block, 0 until claimed",
        )
        ws.add("stream_block_map", "int32", (full_blocks,), "streamed call: the pool block of each laid-out block")
        # The fused mode's streamed call: its claim state in one region (one memset a call), and
        # the expert of each block it opens.
        bpe = stream_blocks_per_expert(t, r, block_m)
        ws.add(
            "stream_claim_words",
            "uint32",
            (sum(streamed_claim_words(el, bpe, sl, full_blocks).values()),),
            "fused streamed call: rows and blocks claimed, slots and chunks done, block words, ready list",
        )
        ws.add("stream_block_expert", "uint32", (full_blocks,), "fused streamed call: the expert of each block")
    if r > 1:
        ws.add("ep_send_counts", "int32", (e,), "this rank's pairs per global expert")
        ws.add("ep_send_offsets", "int32", (e + 1,), "send list layout: exclusive scan of ep_send_counts")
        ws.add("ep_send_cursors", "int32", (e,), "send-list entries claimed so far per global expert")
        ws.add("ep_src_rows", "int32", (el, r + 1), "first pool row of each (local expert, source rank)")
        ws.add("ep_expert_totals", "int32", (el,), "rows received per local expert from all ranks")
        ws.add(
            "ep_banks",
            "uint32",
            (_PARITY_BANKS, ep_bank_words(r, el)),
            "written by peers, per launch parity: received counts and send-list offsets, "
            "count_ready and combine_ready words, the most pool cycles of any rank",
        )
        ws.add("peer_bases", "uint64", (r,), "base address of every rank's buffer, as this rank maps it")
    ws_bytes = align_up(ws.cursor, REGION_ALIGN)

    top = _Packer(REGION_ALIGN)
    if r > 1:
        # One rank reads the caller's x and x_sf directly; across ranks they are staged here,
        # where the ranks owning a token's experts pull its row from.
        top.add("x", "e4m3", (t, h), "input tokens, FP8, staged for peers to pull")
        top.add(
            "x_sf",
            "float32",
            (t, h // _SF_BLOCK),
            "input scales, one row per token as the caller passes them (peers pull a token's row)",
        )
    if streaming:
        ring_rows = stream_slots * stream_tokens
        top.add("stream_x", "e4m3", (ring_rows, h), "input ring: tokens of each slot's chunk, FP8")
        top.add("stream_x_sf", "float32", (ring_rows, h // _SF_BLOCK), "input ring: their scales, a row per token")
        top.add("stream_topk_idx", "int32", (ring_rows, k), "input ring: their expert ids, -1 = empty")
        top.add("stream_topk_weights", "float32", (ring_rows, k), "input ring: their top-k weights")
        top.add("stream_call_topk_idx", "int32", (t, k), "streamed call: its expert ids, kept for the combine")
    top.add("l1_pool", "e4m3", (rows, h), "received rows grouped by local expert")
    top.add("l1_pool_sf", "float32", (h // _SF_BLOCK, rows), "scales of l1_pool, k-block-major")
    top.add("l1_pool_src", "int32", (meta_rows,), "source of each row: (src_rank*T + token)*K + slot, -1 for padding")
    top.add("l1_pool_weight", "float32", (meta_rows,), "top-k weight of each row, applied in the L1 epilogue")
    top.add(
        "l1_pool_dst",
        "uint64",
        (meta_rows,),
        "byte address each row's L2 output goes to (its combine slot, local or a peer's)",
    )
    top.add("l2_pool", "e4m3", (rows, i), "L1 output (activated), L2 input")
    top.add("l2_pool_sf", "float32", (i // act_sf_gran, rows), "scales of l2_pool, k-block-major")
    top.add("combine", "bf16", (k, t, h), "expert outputs returned per top-k slot")
    if ep_staging:
        if r == 1:
            raise ValueError("ep_staging: staging rows carry partials to other ranks; one rank has none")
        top.add("ep_staging", "bf16", (rows, h), "partials owed to other ranks, by pool data row, until put")
    if r > 1:
        top.add(
            "send_list",
            "uint64",
            (t * k,),
            "this rank's routed pairs grouped by expert: (weight bits << 32) | token * K + slot",
        )
    top.add("workspace", "uint8", (ws_bytes,), "counters, flags and barrier words")

    return BufferLayout(
        hidden=h,
        intermediate=i,
        num_experts=e,
        num_topk=k,
        num_max_tokens_per_rank=t,
        num_ranks=r,
        num_local_experts=el,
        block_m=block_m,
        act_sf_gran=act_sf_gran,
        pool=pool,
        pool_blocks=pool_blocks,
        pool_rows=rows,
        regions=tuple(top.regions),
        workspace=tuple(ws.regions),
        total_bytes=align_up(top.cursor, REGION_ALIGN),
        stream_slots=stream_slots if streaming else 0,
        stream_tokens=stream_tokens if streaming else 0,
    )
