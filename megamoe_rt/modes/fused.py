"""The fused mode of :class:`~megamoe_rt.layer.MegaMoE`: one cooperative launch per call.

:class:`FusedPlan` resolves everything a launch needs once per buffer and weights (tensor
maps, the parameter struct, shared-memory size, the schedule the ring was sized for); a call
only fills in its inputs and its schedule (lag or single wave, from ``num_tokens_bound``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from megamoe_rt.runtime import driver
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.kernels import fused as fk
from megamoe_rt.kernels.gemm import FLAG_CLAMP, FLAG_POW2_SCALE, GemmParams
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.kernels.moe import MoeParams
from megamoe_rt.kernels.operands import Fp8Operand, ScaleFactors
from megamoe_rt.schedule.layout import BufferLayout
from megamoe_rt.schedule.plan import FusedSchedule, fused_schedule, live_blocks_upper_bound, single_wave_fits

BLOCK_M = fk.BLOCK_M
GROUP_UNITS = 4
# Calls bounded by at most this many tokens per rank launch with programmatic dependent launch:
# their kernel is short enough that overlapping its prologue with the previous kernel counts.
PDL_MAX_TOKENS = 256


@dataclass(frozen=True)
class CallSchedule:
    """The order one call runs in."""

    single_wave: bool
    lag_units: int       # the lag of the stream (single wave: the unit bound, i.e. no L2 before the last L1)
    group_units: int


def buffer_schedule(layout: BufferLayout) -> FusedSchedule:
    """The schedule of a fused buffer: the lag of its token capacity, its ring.

    Raises ValueError when the ring is below that lag's live window and does not cover the
    whole worst-case pool (the ring could be overwritten while still being read)."""
    s = fused_schedule(layout.num_max_tokens_per_rank, layout.num_ranks, layout.num_topk, layout.num_experts,
                       block_m=BLOCK_M)
    return FusedSchedule(lag_units=s.lag_units, group_units=s.group_units, ring_blocks=layout.pool_blocks,
                         full_pool_blocks=s.full_pool_blocks)


def call_schedule(layout: BufferLayout, buffer: FusedSchedule, num_tokens_bound: int) -> CallSchedule:
    """Lag or single wave for a call bounded by ``num_tokens_bound`` tokens per rank.

    The lag comes from the bound, clamped to the buffer's (the ring is sized for that one);
    a call whose worst-case pool fits the ring needs no lag at all.
    """
    r, k, e = layout.num_ranks, layout.num_topk, layout.num_experts
    if single_wave_fits(num_tokens_bound, r, k, e, buffer.ring_blocks, block_m=BLOCK_M):
        return CallSchedule(True, max(buffer.full_pool_blocks, 1), GROUP_UNITS)
    lag = min(fused_schedule(num_tokens_bound, r, k, e, block_m=BLOCK_M).lag_units, buffer.lag_units)
    call = FusedSchedule(lag_units=lag, group_units=GROUP_UNITS, ring_blocks=buffer.ring_blocks,
                         full_pool_blocks=buffer.full_pool_blocks)
    # The ring must hold the live window of this call's order (FusedSchedule checks it too).
    assert call.covers_full_pool or buffer.ring_blocks >= live_blocks_upper_bound(call)
    return CallSchedule(False, lag, GROUP_UNITS)


class FusedPlan:
    """One buffer's fused launch: parameters, tensor maps and kernel, resolved once."""

    def __init__(self, buffer: Any, layout: BufferLayout, *, w1p: Any, w1p_sf: Any, w2: Any, w2_sf: Any,
                 act_sf_gran: int, swiglu_limit: float | None, pow2_scale: bool, sm_count: int, device: int,
                 idx: str = "int32"):
        self.layout = layout
        self.schedule = buffer_schedule(layout)
        self.max_blocks = self.schedule.full_pool_blocks
        if self.max_blocks > fk.MAX_BLOCKS:
            raise ValueError(f"num_max_tokens_per_rank: the worst-case pool of {self.max_blocks} blocks exceeds "
                             f"the fused kernel's {fk.MAX_BLOCKS}")
        el, h, i = layout.num_local_experts, layout.hidden, layout.intermediate
        self.expert_parallel = layout.num_ranks > 1
        ep_extra = fk.ep_scratch_bytes(layout.num_experts, el, layout.num_ranks)
        self.stages = fk.pick_stages(el, self.max_blocks, ep_extra)
        self.smem_bytes = fk.dynamic_smem_bytes(self.stages, el, self.max_blocks, ep_extra)
        self.sm_count = sm_count
        self.device = device
        self.act_sf_gran = act_sf_gran
        self._kernels: dict[str, Any] = {}
        self._idx = idx
        ring_rows = layout.pool_rows
        b = buffer
        flags = (FLAG_CLAMP if swiglu_limit is not None else 0) | (FLAG_POW2_SCALE if pow2_scale else 0)
        self.l1 = GemmParams(num_rows=ring_rows, n=2 * i, k=h, num_groups=el, flags=flags,
                             sfb=int(w1p_sf.data.ptr), d=b.ptr("l2_pool"), d_row_stride_bytes=i,
                             d_sf=b.ptr("l2_pool_sf"), d_sf_row_stride=ring_rows, row_weight=b.ptr("l1_pool_weight"),
                             swiglu_limit=0.0 if swiglu_limit is None else swiglu_limit)
        self.l2 = GemmParams(num_rows=ring_rows, n=h, k=i, num_groups=el, sfb=int(w2_sf.data.ptr),
                             row_dst=b.ptr("l1_pool_dst"))
        bank = fk.bank_layout(layout.num_experts, self.max_blocks)
        banks_ptr = b.ptr("fused_banks")
        self.banks = (ctypes.c_uint64 * 2)(banks_ptr, banks_ptr + 4 * bank.words)
        self.bank = bank
        # The pools are rings of ring_rows rows with k-major row scales; the weights [el, n, k] with
        # block scales (w1p's per 64-row gate|up half).
        l1_a = Fp8Operand("l1_pool", b.ptr("l1_pool"), rows=ring_rows, k=h,
                          scales=ScaleFactors("l1_pool_sf", b.ptr("l1_pool_sf"), gran_k=128, kmajor=True,
                                              row_stride=ring_rows))
        l1_b = Fp8Operand("w1p", int(w1p.data.ptr), rows=2 * i, k=h, groups=el, stacked=True, rows_label="N",
                          scales=ScaleFactors("w1p_sf", int(w1p_sf.data.ptr), gran_k=128, gran_rows=64))
        l2_a = Fp8Operand("l2_pool", b.ptr("l2_pool"), rows=ring_rows, k=i,
                          scales=ScaleFactors("l2_pool_sf", b.ptr("l2_pool_sf"), gran_k=act_sf_gran, kmajor=True,
                                              row_stride=ring_rows))
        l2_b = Fp8Operand("w2", int(w2.data.ptr), rows=h, k=i, groups=el, stacked=True, rows_label="N",
                          scales=ScaleFactors("w2_sf", int(w2_sf.data.ptr), gran_k=128, gran_rows=128))
        self.tensor_maps = [
            l1_a.tensor_map(BLOCK_M), l1_b.tensor_map(fk.BLOCK_N), l1_a.scale_tensor_map(BLOCK_M),
            l2_a.tensor_map(BLOCK_M), l2_b.tensor_map(fk.BLOCK_N), l2_a.scale_tensor_map(BLOCK_M),
        ]
        self._buffer = buffer
        self._weights = (w1p, w1p_sf, w2, w2_sf)  # the tensor maps point into them
        self._ep_fields = {}
        if self.expert_parallel:
            from megamoe_rt.modes.unfused_ep import write_peer_table
            from megamoe_rt.kernels.ep import bank_layout as ep_bank_layout

            write_peer_table(buffer)
            ws = layout.region("workspace").offset
            self._ep_fields = dict(
                peer_bases=b.ptr("peer_bases"), off_x=layout.region("x").offset,
                off_x_sf=layout.region("x_sf").offset, off_send_list=layout.region("send_list").offset,
                off_combine=layout.region("combine").offset,
                off_ep_banks=ws + layout.workspace_region("ep_banks").offset, send_list=b.ptr("send_list"),
                ep_banks=b.ptr("ep_banks"), ep_bank=ep_bank_layout(layout.num_ranks, el),
                rank=buffer.rank, num_ranks=layout.num_ranks)

    def kernel(self, idx: str):
        if idx not in self._kernels:
            cfg = fk.FusedConfig(self.stages, self.act_sf_gran, idx, self.expert_parallel)
            k = get_kernel(cfg.spec(), self.device)
            if k.max_active_blocks_per_sm(fk.NUM_THREADS, self.smem_bytes) < 1:
                raise driver.GpuUnavailableError(f"{cfg.name}: cannot keep one block per SM resident")
            self._kernels[idx] = k
        return self._kernels[idx]

    def params(self, moe: MoeParams, schedule: CallSchedule, *, timeout_s: float | None = None,
               withhold_block: int | None = None, trace_ptr: int = 0) -> fk.FusedParams:
        b = self._buffer
        rank = self._ep_fields.get("rank", 0)
        return fk.FusedParams(
            moe=moe, l1=self.l1, l2=self.l2, wait=TimeoutRecord.get().context(timeout_s, rank=rank),
            banks=self.banks, bank=self.bank, launch_epoch=b.ptr("launch_epoch"), grid_barrier=b.ptr("grid_sync"),
            ring_blocks=self.layout.pool_blocks, max_blocks=self.max_blocks, lag_units=schedule.lag_units,
            group_units=schedule.group_units, table_smem_offset=fk.tile_smem_bytes(self.stages),
            withhold_block=fk.NO_BLOCK if withhold_block is None else int(withhold_block), trace=trace_ptr,
            **self._ep_fields)

    def launch(self, idx: str, params: fk.FusedParams, stream: int, *, programmatic: bool = False) -> None:
        args = [params] + [t.raw for t in self.tensor_maps]
        self.kernel(idx).launch((self.sm_count,), (fk.NUM_THREADS,), args, stream=stream,
                                smem_bytes=self.smem_bytes, cooperative=True, programmatic=programmatic)
        # The arguments are copied at launch (and into a graph node when captured).
        self._last_args = args
