"""A streamed call in the fused mode (one rank): the fused kernel's ``streamed`` role consumes the
input ring chunk by chunk and starts L1 on a pool block once the block is complete
(cuda_src/fused/streamed_call.cuh; docs/STREAMING.md, "Streaming into the fused kernel").

Per call: one memset zeroes the call's claim state (``stream_claim_words``); the ring's consumer
side begins the call; one launch (an ordinary one, not cooperative) on ``consumer_sms`` SMs does
the rest, the combine included. The launch's blocks hold their SMs for the whole call, so the producer's kernels run on
the SMs it leaves (``StreamConfig.producer_sms``). The pool is the full worst-case pool.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.kernels import fused as fk
from megamoe_rt.kernels.interface.structs import ReadyBlocks, StreamedPool
from megamoe_rt.modes.base import Call, LayerSpec
from megamoe_rt.runtime import streams
from megamoe_rt.runtime.buffer import LayerBuffer
from megamoe_rt.schedule.arith import ceil_div
from megamoe_rt.schedule.layout import (
    BufferLayout,
    stream_blocks_per_expert,
    streamed_claim_offsets,
    streamed_claim_words,
)


def streamed_width_refusal(hidden: int, intermediate: int) -> str | None:
    """Why the streamed role cannot run a layer this wide (its tile word holds an n-block in 6
    bits: both layers at most STREAMED_MAX_N_BLOCKS tiles wide), or None."""
    n1, n2 = 2 * intermediate // fk.BLOCK_N, hidden // fk.BLOCK_N
    if max(n1, n2) <= fk.STREAMED_MAX_N_BLOCKS:
        return None
    return (
        f"streaming: hidden={hidden}, intermediate={intermediate} give {n2} / {n1} tiles of {fk.BLOCK_N} "
        f"columns; mode='fused' streams layers of at most {fk.STREAMED_MAX_N_BLOCKS} (mode='unfused' streams any)"
    )


def streamed_lag(grid: int, l1_tiles: int, l2_tiles: int) -> int:
    """The task order's lag in ready-list positions: L2 of position ``j - lag`` follows L1 of
    ``j``. About a grid's worth of tiles lies between an L1 task and the L2 that reads it, so
    the L2 rarely waits for tiles still running; two grids' worth, as the batch order's lag."""
    return max(1, ceil_div(2 * grid, l1_tiles + l2_tiles))


class StreamedFusedCall:
    """The regions and parameters of the fused mode's streamed calls on one buffer."""

    def __init__(self, spec: LayerSpec, layout: BufferLayout, buffer: LayerBuffer):
        cfg = spec.streaming
        assert cfg is not None and not spec.expert_parallel, "one rank with an input ring"
        assert layout.pool_blocks == layout.full_pool_blocks, "a streamed call holds the full pool"
        self.spec, self.layout = spec, layout
        wide = streamed_width_refusal(spec.hidden, spec.intermediate)
        if wide is not None:
            raise ValueError(wide)
        n1, n2 = 2 * spec.intermediate // fk.BLOCK_N, spec.hidden // fk.BLOCK_N
        self.grid = cfg.consumer_sms(spec.sm_count)
        self.lag = streamed_lag(self.grid, n1, n2)
        el, blocks = spec.num_local_experts, layout.full_pool_blocks
        bpe = stream_blocks_per_expert(layout.num_max_tokens_per_rank, 1, layout.block_m)
        self._claim_base = buffer.ptr("stream_claim_words")
        self._claim_words = sum(streamed_claim_words(el, bpe, cfg.num_slots, blocks).values())
        at = {k: self._claim_base + 4 * v for k, v in streamed_claim_offsets(el, bpe, cfg.num_slots, blocks).items()}
        self._fixed = dict(
            expert_counts=at["expert_counts"],
            expert_blocks=at["expert_blocks"],
            blocks_claimed=at["blocks_claimed"],
            block_expert=buffer.ptr("stream_block_expert"),
            slot_done=at["slot_done"],
            parts_done=at["parts_done"],
            call_topk_idx=buffer.ptr("stream_call_topk_idx"),
            blocks_per_expert=bpe,
            lag=self.lag,
        )
        self._ready = ReadyBlocks(
            state=at["state"], ready=at["ready"], ready_count=at["ready_count"], sealed=at["sealed"], capacity=blocks
        )
        self.call_topk_idx = self._fixed["call_topk_idx"]

    def pool(self, ring: Any, num_tokens: int) -> StreamedPool:
        """The launch's ``FusedParams::streamed`` for a call of ``num_tokens`` tokens."""
        cfg = self.spec.streaming
        assert cfg is not None
        return StreamedPool(
            ring=ring.descriptor, ready=self._ready, num_chunks=cfg.num_chunks(num_tokens), **self._fixed
        )

    def reset(self, stream: int) -> None:
        """Zero the claim state before a call (a memset node when captured)."""
        streams.memset_d32_async(self._claim_base, 0, self._claim_words, stream)

    def moe_call(self, call: Call) -> Call:
        """The call as the kernel's MoE parameters see it: no inputs of its own (the dispatch
        reads each chunk from the ring), its expert ids for the combine in the call-wide copy."""
        return Call(0, 0, self.call_topk_idx, 0, call.y, call.num_tokens, "int32", call.bound)
