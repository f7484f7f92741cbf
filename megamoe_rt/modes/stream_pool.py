"""A streamed call through one call-wide pool (cuda_src/moe/stream_pool.cu): how the unfused
mode runs ``MegaMoE.consume`` on one rank with a full pool.

Per call: reset the pool's claim state; then per chunk, once the producer has published it,
one dispatch launch claims rows of the chunk's experts a block at a time and copies the rows
in, and the chunk's slot is released right away (the producer never waits for the GEMMs);
after the last chunk the seal lays the experts out over the claimed blocks, both grouped GEMMs
run once over the whole call through the block map, and the combine reads the call's expert
ids from the copy the dispatch kept. Each expert's weights are read once per call, as in the
batch call (a chunk run as a call of its own reads all of them again per chunk).

Chunk-local calls (``UnfusedMode._run_chunks``) remain the path across ranks and with a ring
pool: there the pool's blocks cannot all be held until the seal.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.kernels import moe as mk
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.modes.base import Call, LayerSpec
from megamoe_rt.runtime import driver
from megamoe_rt.runtime.buffer import LayerBuffer
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.schedule.layout import BufferLayout, stream_blocks_per_expert


class StreamPool:
    """The call-wide pool of a streamed call: its regions in the layer's buffer and kernels."""

    def __init__(self, spec: LayerSpec, layout: BufferLayout, buffer: LayerBuffer):
        assert spec.streaming is not None and not spec.expert_parallel, "one rank with an input ring"
        self.spec, self.layout = spec, layout
        b = buffer
        self._counts = b.ptr("expert_recv_counts")
        self._claimed = b.ptr("stream_blocks_claimed")
        self._expert_blocks = b.ptr("stream_expert_blocks")
        self.block_map = b.ptr("stream_block_map")
        self.call_topk_idx = b.ptr("stream_call_topk_idx")
        self._blocks_per_expert = stream_blocks_per_expert(layout.num_max_tokens_per_rank, 1, layout.block_m)
        self._kernels: dict[str, Any] = {}

    def load_kernels(self) -> None:
        if not self._kernels:
            dev = self.spec.device
            self._kernels = {
                "dispatch": get_kernel(mk.stream_dispatch_spec(), dev),
                "seal": get_kernel(mk.stream_seal_spec(), dev),
                "combine": get_kernel(mk.combine_spec("int32"), dev),
            }

    def _params(self, moe: mk.MoeParams, wait: Any) -> mk.StreamPoolParams:
        return mk.StreamPoolParams(
            moe=moe,
            expert_blocks=self._expert_blocks,
            blocks_claimed=self._claimed,
            block_map=self.block_map,
            call_topk_idx=self.call_topk_idx,
            wait=wait,
            blocks_per_expert=self._blocks_per_expert,
            pool_blocks=self.layout.pool_blocks,
        )

    def run(self, mode: Any, call: Call, gemms: tuple[Any, Any], stream: int) -> None:
        """Enqueue ``call`` (``call.y``, ``call.num_tokens``, ``call.bound``) of ``mode`` (the
        unfused mode: its input ring and MoE parameters) with its two GEMM plans."""
        s, ring, cfg = self.spec, mode.input_ring, self.spec.streaming
        assert ring is not None and cfg is not None
        self.load_kernels()
        el, c_tokens = s.num_local_experts, cfg.tokens_per_slot
        driver.memset_d32_async(self._counts, 0, el, stream)
        driver.memset_d32_async(self._claimed, 0, 1, stream)
        driver.memset_d32_async(self._expert_blocks, 0, el * self._blocks_per_expert, stream)
        ring.begin_consume(stream)
        wait = TimeoutRecord.get().context(s.timeout_s, rank=s.rank)  # once a call: it reads the environment
        for chunk in range(cfg.num_chunks(call.bound)):
            n = cfg.chunk_tokens(call.num_tokens, chunk)
            if not n:
                continue
            ring.wait_chunk(chunk, stream)
            at = ring.slot_addresses(chunk % cfg.num_slots)
            moe = mode.moe_params(Call(at.x, at.x_sf, at.topk_idx, at.topk_weights, call.y, n, "int32", n))
            moe.token_base = chunk * c_tokens
            grid = mk.grids(n, s.num_topk, s.sm_count)["dispatch"]
            self._kernels["dispatch"].launch((grid,), (mk.DISPATCH_THREADS,), [self._params(moe, wait)], stream=stream)
            ring.release_chunk(chunk, stream)  # the rows are in the pool: the producer may refill the slot
        if call.num_tokens:
            whole = mode.moe_params(Call(0, 0, self.call_topk_idx, 0, call.y, call.num_tokens, "int32", call.bound))
            self._kernels["seal"].launch((1,), (mk.SCAN_THREADS,), [self._params(whole, wait)], stream=stream)
            for gemm in gemms:
                gemm.run_block_mapped(stream, self.block_map)
            mk.launch_combine(self._kernels, whole, mk.grids(call.num_tokens, s.num_topk, s.sm_count), stream)
        ring.note_consumer(stream)
