"""A streamed call through one call-wide pool (cuda_src/moe/stream_pool.cu): how the unfused
mode runs ``MegaMoE.consume`` on one rank with a full pool.

Per call: reset the pool's claim state; then one launch walks every chunk: once the producer
has published a chunk, its blocks claim rows of the chunk's experts a pool block at a time and
copy the rows in, and the last block done releases the slot (the producer never waits for the
GEMMs, and the host launches nothing per chunk); then the seal lays the experts out over the
claimed blocks, both grouped GEMMs run once over the whole call through the block map, and the
combine reads the call's expert ids from the copy the consumer kept. Each expert's weights are
read once per call, as in the batch call (a chunk run as a call of its own reads all of them
again per chunk).

Chunk-local calls (``UnfusedMode._run_chunks``) remain the path across ranks and with a ring
pool: there the pool's blocks cannot all be held until the seal.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.kernels import moe as mk
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.modes.base import Call, LayerSpec
from megamoe_rt.runtime import streams
from megamoe_rt.runtime.buffer import LayerBuffer
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.runtime.launches import StreamLaunches
from megamoe_rt.schedule.layout import BufferLayout, stream_blocks_per_expert


def consume_grid(sm_count: int, pairs: int, num_slots: int, num_chunks: int) -> tuple[int, int]:
    """Blocks of the consumer launch and the groups they form (chunks consumed at once).

    One block an SM at most: a block holds under a third of its SM's registers and no shared
    memory, and the kernel asks for the SMs' full shared memory (prefer_max_shared_memory), so
    the producer's blocks always find room next to blocks waiting for their chunks. No more
    blocks than give every warp at least one of a call's pairs. One group per slot (as many
    chunks as the ring can hold published at once), at most one per chunk and per block; the
    grid is cut to a multiple of the groups."""
    grid = max(1, min(sm_count, -(-pairs // (mk.DISPATCH_THREADS // 32))))
    groups = max(1, min(num_slots, num_chunks, grid))
    return grid // groups * groups, groups


class StreamPool:
    """The call-wide pool of a streamed call: its regions in the layer's buffer and kernels."""

    def __init__(self, spec: LayerSpec, layout: BufferLayout, buffer: LayerBuffer):
        assert spec.streaming is not None and not spec.expert_parallel, "one rank with an input ring"
        self.spec, self.layout = spec, layout
        b = buffer
        self._counts = b.ptr("expert_recv_counts")
        self._claimed = b.ptr("stream_blocks_claimed")
        self._slot_done = b.ptr("stream_slot_done")
        self._expert_blocks = b.ptr("stream_expert_blocks")
        self.block_map = b.ptr("stream_block_map")
        self.call_topk_idx = b.ptr("stream_call_topk_idx")
        self._blocks_per_expert = stream_blocks_per_expert(layout.num_max_tokens_per_rank, 1, layout.block_m)
        self._kernels: dict[str, Any] = {}

    def load_kernels(self) -> None:
        if not self._kernels:
            dev = self.spec.device
            self._kernels = {
                "consume": get_kernel(mk.stream_consume_spec(), dev),
                "seal": get_kernel(mk.stream_seal_spec(), dev),
                "combine": get_kernel(mk.combine_spec("int32"), dev),
            }
            # Its blocks wait for the producer's kernels: the SMs they sit on must keep room for
            # producer blocks that use shared memory.
            self._kernels["consume"].prefer_max_shared_memory()

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
        el = s.num_local_experts
        streams.memset_d32_async(self._counts, 0, el, stream)
        streams.memset_d32_async(self._claimed, 0, 1, stream)
        streams.memset_d32_async(self._expert_blocks, 0, el * self._blocks_per_expert, stream)
        streams.memset_d32_async(self._slot_done, 0, cfg.num_slots, stream)
        ring.begin_consume(stream)
        wait = TimeoutRecord.get().context(s.timeout_s, rank=s.rank)  # once a call: it reads the environment
        whole = mode.moe_params(Call(0, 0, self.call_topk_idx, 0, call.y, call.num_tokens, "int32", call.bound))
        if call.num_tokens:
            params = mk.StreamConsumeParams(
                pool=self._params(whole, wait),
                ring=ring.descriptor,
                slot_done=self._slot_done,
                num_chunks=cfg.num_chunks(call.bound),
            )
            grid, params.chunk_groups = consume_grid(
                s.sm_count, call.num_tokens * s.num_topk, cfg.num_slots, cfg.num_chunks(call.num_tokens)
            )
            self._kernels["consume"].launch((grid,), (mk.DISPATCH_THREADS,), [params], stream=stream)
            self._kernels["seal"].launch((1,), (mk.SCAN_THREADS,), [self._params(whole, wait)], stream=stream)
            for gemm in gemms:
                gemm.run_block_mapped(stream, self.block_map)
            grids = mk.grids(call.num_tokens, s.num_topk, s.sm_count)
            mk.launch_combine(self._kernels, whole, grids, StreamLaunches(stream))
        ring.note_consumer(stream)
