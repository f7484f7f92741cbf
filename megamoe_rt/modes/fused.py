"""The fused mode of :class:`~megamoe_rt.layer.MegaMoE`: one cooperative launch per call.

:class:`FusedMode` runs routing, dispatch, both GEMMs in a lag task order over ring
pools, and the combine in one persistent kernel, on one rank or across ranks.
:class:`FusedSchedules` derives the buffer's schedule once and each call bound's schedule at
its first use; :class:`FusedPlan` resolves everything a launch needs once per buffer and
weights (tensor maps, the fixed part of the parameter struct, shared-memory size). A call
only fills in its inputs and looks up its schedule (lag or single wave, from ``num_tokens_bound``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from megamoe_rt.kernels import fused as fk
from megamoe_rt.kernels.ep import bank_layout as ep_bank_layout
from megamoe_rt.kernels.gemm import FLAG_CLAMP, FLAG_POW2_SCALE, GemmParams, ScatterBf16Params, SwigluFp8Params
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.kernels.moe import MoeParams
from megamoe_rt.kernels.operands import Fp8Operand, ScaleFactors
from megamoe_rt.modes.base import Call, LayerSpec, LayoutNeeds, Mode, Weights, pool_memory_line
from megamoe_rt.modes.fused_stream import StreamedFusedCall, streamed_width_refusal
from megamoe_rt.modes.peers import stage_inputs
from megamoe_rt.runtime import driver
from megamoe_rt.runtime.buffer import LayerBuffer, SymmetricLayerBuffer
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.schedule.layout import BufferLayout
from megamoe_rt.schedule.plan import (
    FusedSchedule,
    align_tokens,
    fused_schedule,
    live_blocks_upper_bound,
    single_wave_fits,
)

BLOCK_M = fk.BLOCK_M
GROUP_UNITS = 4
# Calls bounded by at most this many tokens per rank launch with programmatic dependent launch:
# their kernel is short enough that overlapping its prologue with the previous kernel counts.
PDL_MAX_TOKENS = 256


@dataclass(frozen=True)
class CallSchedule:
    """The order one call runs in."""

    single_wave: bool
    lag_units: int  # the lag of the task order (single wave: the unit bound, i.e. no L2 before the last L1)
    group_units: int


def buffer_schedule(layout: BufferLayout) -> FusedSchedule:
    """The schedule of a fused buffer: the lag of its token capacity, its ring.

    Raises ValueError when the ring is below that lag's live window and does not cover the
    whole worst-case pool (the ring could be overwritten while still being read)."""
    s = fused_schedule(
        layout.num_max_tokens_per_rank, layout.num_ranks, layout.num_topk, layout.num_experts, block_m=BLOCK_M
    )
    return FusedSchedule(
        lag_units=s.lag_units,
        group_units=s.group_units,
        ring_blocks=layout.pool_blocks,
        full_pool_blocks=s.full_pool_blocks,
    )


def call_schedule(layout: BufferLayout, buffer: FusedSchedule, num_tokens_bound: int) -> CallSchedule:
    """Lag or single wave for a call bounded by ``num_tokens_bound`` tokens per rank.

    The lag comes from the bound, clamped to the buffer's (the ring is sized for that one);
    a call whose worst-case pool fits the ring needs no lag at all.
    """
    r, k, e = layout.num_ranks, layout.num_topk, layout.num_experts
    if single_wave_fits(num_tokens_bound, r, k, e, buffer.ring_blocks, block_m=BLOCK_M):
        return CallSchedule(True, max(buffer.full_pool_blocks, 1), GROUP_UNITS)
    lag = min(fused_schedule(num_tokens_bound, r, k, e, block_m=BLOCK_M).lag_units, buffer.lag_units)
    call = FusedSchedule(
        lag_units=lag, group_units=GROUP_UNITS, ring_blocks=buffer.ring_blocks, full_pool_blocks=buffer.full_pool_blocks
    )
    # The ring must hold the live window of this call's order (FusedSchedule checks it too).
    assert call.covers_full_pool or buffer.ring_blocks >= live_blocks_upper_bound(call)
    return CallSchedule(False, lag, GROUP_UNITS)


class FusedSchedules:
    """The schedules of one fused buffer.

    The buffer's schedule (the lag its ring was sized for) is derived once, when the mode is
    created; a call's order depends only on its bound, so each bound's is derived at its first
    call and looked up afterwards (a layer sees few distinct bounds, at most its capacity).
    """

    def __init__(self, layout: BufferLayout):
        self.layout = layout
        self.buffer = buffer_schedule(layout)  # a ring below the live window is refused here
        self._calls: dict[int, CallSchedule] = {}

    def for_bound(self, num_tokens_bound: int) -> CallSchedule:
        s = self._calls.get(num_tokens_bound)
        if s is None:
            s = self._calls[num_tokens_bound] = call_schedule(self.layout, self.buffer, num_tokens_bound)
        return s

    def __len__(self) -> int:
        """Bounds seen so far."""
        return len(self._calls)


class FusedPlan:
    """One buffer's fused launch: parameters, tensor maps and kernel, resolved once."""

    def __init__(
        self,
        buffer: LayerBuffer,
        layout: BufferLayout,
        schedule: FusedSchedule,
        weights: Weights,
        *,
        act_sf_gran: int,
        swiglu_limit: float | None,
        pow2_scale: bool,
        sm_count: int,
        device: int,
    ):
        w1p, w1p_sf, w2, w2_sf = weights
        self.layout = layout
        self.schedule = schedule
        self.max_blocks = schedule.full_pool_blocks
        if self.max_blocks > fk.MAX_BLOCKS:
            raise ValueError(
                f"num_max_tokens_per_rank: the worst-case pool of {self.max_blocks} blocks exceeds "
                f"the fused kernel's {fk.MAX_BLOCKS}"
            )
        el, h, i = layout.num_local_experts, layout.hidden, layout.intermediate
        self.expert_parallel = layout.num_ranks > 1
        ep_extra = fk.ep_scratch_bytes(layout.num_experts, el, layout.num_ranks)
        self.stages = fk.pick_stages(el, ep_extra)
        self.smem_bytes = fk.dynamic_smem_bytes(self.stages, el, ep_extra)
        self.sm_count = sm_count
        self.device = device
        self.act_sf_gran = act_sf_gran
        self._kernels: dict[str, Any] = {}
        ring_rows = layout.pool_rows
        b = buffer
        flags = (FLAG_CLAMP if swiglu_limit is not None else 0) | (FLAG_POW2_SCALE if pow2_scale else 0)
        # The GEMM halves' `wait` stays empty: the fused kernel's pipeline waits take FusedParams::wait.
        self.l1 = GemmParams(num_rows=ring_rows, n=2 * i, k=h, num_groups=el, sfb=int(w1p_sf.data.ptr))
        self.l1_out = SwigluFp8Params(
            d=b.ptr("l2_pool"),
            d_row_stride_bytes=i,
            d_sf=b.ptr("l2_pool_sf"),
            d_sf_row_stride=ring_rows,
            row_weight=b.ptr("l1_pool_weight"),
            swiglu_limit=0.0 if swiglu_limit is None else swiglu_limit,
            flags=flags,
        )
        self.l2 = GemmParams(num_rows=ring_rows, n=h, k=i, num_groups=el, sfb=int(w2_sf.data.ptr))
        self.l2_out = ScatterBf16Params(row_dst=b.ptr("l1_pool_dst"))
        bank = fk.bank_layout(layout.num_experts, self.max_blocks)
        banks_ptr = b.ptr("fused_banks")
        self.banks = (ctypes.c_uint64 * 2)(banks_ptr, banks_ptr + 4 * bank.words)
        self.bank = bank
        # The pools are rings of ring_rows rows with k-major row scales; the weights [el, n, k] with
        # block scales (w1p's per 64-row gate|up half).
        l1_a = Fp8Operand(
            "l1_pool",
            b.ptr("l1_pool"),
            rows=ring_rows,
            k=h,
            scales=ScaleFactors("l1_pool_sf", b.ptr("l1_pool_sf"), gran_k=128, kmajor=True, row_stride=ring_rows),
        )
        l1_b = Fp8Operand(
            "w1p",
            int(w1p.data.ptr),
            rows=2 * i,
            k=h,
            groups=el,
            stacked=True,
            rows_label="N",
            scales=ScaleFactors("w1p_sf", int(w1p_sf.data.ptr), gran_k=128, gran_rows=64),
        )
        l2_a = Fp8Operand(
            "l2_pool",
            b.ptr("l2_pool"),
            rows=ring_rows,
            k=i,
            scales=ScaleFactors(
                "l2_pool_sf", b.ptr("l2_pool_sf"), gran_k=act_sf_gran, kmajor=True, row_stride=ring_rows
            ),
        )
        l2_b = Fp8Operand(
            "w2",
            int(w2.data.ptr),
            rows=h,
            k=i,
            groups=el,
            stacked=True,
            rows_label="N",
            scales=ScaleFactors("w2_sf", int(w2_sf.data.ptr), gran_k=128, gran_rows=128),
        )
        self.tensor_maps = [
            l1_a.tensor_map(BLOCK_M),
            l1_b.tensor_map(fk.BLOCK_N),
            l1_a.scale_tensor_map(BLOCK_M),
            l2_a.tensor_map(BLOCK_M),
            l2_b.tensor_map(fk.BLOCK_N),
            l2_a.scale_tensor_map(BLOCK_M),
        ]
        self._maps_raw = [t.raw for t in self.tensor_maps]
        self._buffer = buffer
        self._weights = weights  # the tensor maps point into them
        self.rank = 0
        ep_fields = {}
        if self.expert_parallel:
            self.rank = cast(SymmetricLayerBuffer, buffer).rank  # expert-parallel: a symmetric buffer
            ws = layout.region("workspace").offset
            ep_fields = dict(
                peer_bases=b.ptr("peer_bases"),
                off_x=layout.region("x").offset,
                off_x_sf=layout.region("x_sf").offset,
                off_send_list=layout.region("send_list").offset,
                off_combine=layout.region("combine").offset,
                off_ep_banks=ws + layout.workspace_region("ep_banks").offset,
                send_list=b.ptr("send_list"),
                ep_banks=b.ptr("ep_banks"),
                ep_bank=ep_bank_layout(layout.num_ranks, el),
                rank=self.rank,
                num_ranks=layout.num_ranks,
            )
        # Every field of FusedParams but the call's inputs, wait context and order.
        self._fixed = dict(
            l1=self.l1,
            l1_out=self.l1_out,
            l2=self.l2,
            l2_out=self.l2_out,
            banks=self.banks,
            bank=self.bank,
            launch_epoch=b.ptr("launch_epoch"),
            grid_barrier=b.ptr("grid_sync"),
            ring_blocks=layout.pool_blocks,
            max_blocks=self.max_blocks,
            table_smem_offset=fk.tile_smem_bytes(self.stages),
            withhold_block=fk.NO_BLOCK,
            trace=0,
            **ep_fields,
        )

    def kernel(self, idx: str, role: str = "fused"):
        """The loaded kernel for ids of dtype ``idx`` in ``role`` (``kernels.fused.ROLES``)."""
        key = f"{idx},{role}"
        if key not in self._kernels:
            cfg = fk.FusedConfig(self.stages, self.act_sf_gran, idx, self.expert_parallel, role=role)
            k = get_kernel(cfg.spec(), self.device)
            if k.max_active_blocks_per_sm(fk.NUM_THREADS, self.smem_bytes) < 1:
                raise driver.GpuUnavailableError(f"{cfg.name}: cannot keep one block per SM resident")
            self._kernels[key] = k
        return self._kernels[key]

    @property
    def tensor_map_args(self) -> list:
        """The six tensor maps, in the kernel's parameter order after the struct."""
        return list(self._maps_raw)

    def params(self, moe: MoeParams, schedule: CallSchedule, *, timeout_s: float | None = None) -> fk.FusedParams:
        """The launch's parameter struct: the call's inputs in the fixed part, in ``schedule``'s order."""
        return fk.FusedParams(
            moe=moe,
            wait=TimeoutRecord.get().context(timeout_s, rank=self.rank),
            lag_units=schedule.lag_units,
            group_units=schedule.group_units,
            **self._fixed,
        )

    def launch(
        self,
        idx: str,
        params: fk.FusedParams,
        stream: int,
        *,
        programmatic: bool = False,
        role: str = "fused",
        grid: int | None = None,
        cooperative: bool = True,
    ) -> None:
        """Enqueue one launch of ``role`` on ``grid`` blocks (default: one an SM)."""
        args = [params, *self._maps_raw]
        self.kernel(idx, role).launch(
            (self.sm_count if grid is None else grid,),
            (fk.NUM_THREADS,),
            args,
            stream=stream,
            smem_bytes=self.smem_bytes,
            cooperative=cooperative,
            programmatic=programmatic,
        )
        # The arguments are copied at launch (and into a graph node when captured).
        self._last_args = args


ParamsTransform = Callable[[fk.FusedParams], None]


class FusedMode(Mode):
    """One persistent cooperative launch per call, pools sized as rings around the schedule."""

    name = "fused"
    MAX_RANKS = 32  # the signal relay waits on peers with one lane of a warp per rank
    # The streamed role runs when asked for by name (mode="fused", one rank) until it has passed
    # its GPU tests (bench/results/stream_fused_first_runs_2026-12-05.md); the default streams
    # in the unfused mode. It streams over the full pool only.
    streams_by_default = False
    streams_over_ring = False

    @classmethod
    def refusal(cls, spec: LayerSpec) -> str | None:
        if spec.streaming is not None and spec.expert_parallel:
            # Across ranks the unfused kernels run a chunk per call (docs/STREAMING.md).
            return "streaming across ranks: runs in mode='unfused' (a chunk per call of its kernels), not mode='fused'"
        if spec.streaming is not None:
            wide = streamed_width_refusal(spec.hidden, spec.intermediate)
            if wide is not None:
                return wide
        if spec.num_ranks > cls.MAX_RANKS:
            return f"group: {spec.num_ranks} ranks; mode='fused' runs on at most {cls.MAX_RANKS}"
        if spec.expert_parallel and spec.transport != "nvlink":
            return (
                f"transport={spec.transport!r}: mode='fused' reaches other ranks through peer pointers only "
                "(mode='unfused' runs over NVSHMEM's device API)"
            )
        if spec.hidden % fk.BLOCK_N:
            return f"hidden={spec.hidden}: mode='fused' needs a multiple of {fk.BLOCK_N} (its L2 tile width)"
        return None

    @classmethod
    def layout_needs(cls, spec: LayerSpec, ring_blocks: int | None = None) -> LayoutNeeds:
        if spec.streaming is not None:
            # A streamed call holds every block it opens until the call ends (select_mode refuses
            # a ring for it, naming the option given).
            assert ring_blocks is None, "a streamed layer in mode='fused' holds the full pool"
            return LayoutNeeds(pool="full", block_m=BLOCK_M)
        return LayoutNeeds(pool="ring", block_m=BLOCK_M, ring_blocks=ring_blocks)

    @classmethod
    def minimum_ring_blocks(cls, spec: LayerSpec) -> int:
        """The live window of the lag the capacity's schedule uses (buffer_schedule's check, on
        the buffer's capacity: the spec's rounded up to the token granularity)."""
        t = align_tokens(spec.num_max_tokens_per_rank)
        s = fused_schedule(t, spec.num_ranks, spec.num_topk, spec.num_experts, BLOCK_M)
        return min(live_blocks_upper_bound(s), s.full_pool_blocks)

    def __init__(self, spec: LayerSpec, layout: BufferLayout):
        super().__init__(spec, layout)
        if spec.streaming is not None and spec.sm_count:  # 0: no GPU known yet (megamoe-rt plan)
            spec.streaming.consumer_sms(spec.sm_count)  # producer_sms leaves the launch an SM (ValueError)
        self.schedules = FusedSchedules(layout)
        self.plan: FusedPlan | None = None
        self.streamed: StreamedFusedCall | None = None  # streaming=: built at load
        # Applied in order to every launch's parameter struct before it is enqueued. Empty in
        # production; megamoe_rt.testing sets it (withheld blocks, traces, forced orders).
        self.params_transforms: tuple[ParamsTransform, ...] = ()

    def _make_plan(self, schedule: FusedSchedule, weights: Weights) -> FusedPlan:
        s = self.spec
        return FusedPlan(
            self.bound_buffer(),
            self.layout,
            schedule,
            weights,
            act_sf_gran=s.act_sf_gran,
            swiglu_limit=s.swiglu_limit,
            pow2_scale=s.pow2_scale,
            sm_count=s.sm_count,
            device=s.device,
        )

    def load(self, weights: Weights) -> None:
        s = self.spec
        self.plan = self._make_plan(self.schedules.buffer, weights)
        if s.expert_parallel:
            self.plan.kernel("int32")  # int64 ids: load_for_ids at their first call
        if s.streaming is not None:
            self.streamed = StreamedFusedCall(s, self.layout, self.bound_buffer())
            self.plan.kernel("int32", "streamed")

    def load_for_ids(self, idx: str) -> None:
        if self.plan is not None:
            self.plan.kernel(idx)

    def trace_rows(self) -> int:
        """Rows of a trace buffer (megamoe_rt.testing.trace_buffer): one per block of the grid."""
        return self.spec.sm_count

    def launch_params(self, call: Call) -> fk.FusedParams:
        """The parameter struct of one call's launch."""
        assert self.plan is not None, "launch before load"
        params = self.plan.params(
            self.moe_params(call), self.schedules.for_bound(call.bound), timeout_s=self.spec.timeout_s
        )
        for transform in self.params_transforms:
            transform(params)
        return params

    def run(self, call: Call, stream: int) -> None:
        if self.spec.expert_parallel:
            stage_inputs(self.bound_buffer(), call.x, call.x_sf, call.num_tokens, stream)
        assert self.plan is not None, "run before load"
        self.plan.launch(call.idx, self.launch_params(call), stream, programmatic=call.bound <= PDL_MAX_TOKENS)

    def run_streamed(self, call: Call, stream: int) -> None:
        """A call whose inputs come from the input ring: one launch of the ``streamed`` role
        (megamoe_rt/modes/fused_stream.py) after its claim state is zeroed."""
        assert self.plan is not None and self.streamed is not None, "run before load"
        ring = self.input_ring
        assert ring is not None, "a streamed call needs the input ring"
        ring.load_kernels()
        self.streamed.reset(stream)
        ring.begin_consume(stream)
        if call.num_tokens:
            params = self.plan.params(
                self.moe_params(self.streamed.moe_call(call)),
                CallSchedule(False, 0, GROUP_UNITS),  # the streamed order's lag is in params.streamed
                timeout_s=self.spec.timeout_s,
            )
            params.streamed = self.streamed.pool(ring, call.num_tokens)
            for transform in self.params_transforms:
                transform(params)
            # An ordinary launch: its blocks need not start together, only all start. Each takes
            # a whole SM, and the grid leaves the producer's SMs out; what else holds an SM either
            # finishes (copies, routing) or is a producer's one-block wait, one a stream, far
            # fewer than the SMs left out. A cooperative launch would also hold the call back
            # until every SM it needs is free at once.
            self.plan.launch("int32", params, stream, role="streamed", grid=self.streamed.grid, cooperative=False)
        ring.note_consumer(stream)

    def memory_notes(self) -> str:
        s = self.schedules.buffer
        return (
            pool_memory_line(self.spec, self.layout, "fused")
            + f"\nschedule at capacity: lag {s.lag_units} units, group {s.group_units}"
        )

    def close(self) -> None:
        self.plan = None
        super().close()
