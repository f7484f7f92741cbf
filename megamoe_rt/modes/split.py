"""The split mode of :class:`~megamoe_rt.layer.MegaMoE`: three kernels in one CUDA graph.

K1 (routing, dispatch, L1 + SwiGLU + top-k weight + requant) and K2 (L2 + scatter of the
bf16 partials to their combine slots, across ranks to the source rank) are the fused kernel
in two roles, launched side by side in disjoint green-context SM partitions: K2 builds the
same pool tables once K1 publishes its routing and runs each L2 tile once its block's L1
output is published, every wait with a deadline. K3 (cuda_src/split/split_reduce.cu) sums
the top-k partials in slot order after both, on ``SplitSms.reduce`` SMs. A memset node zeroes the
counter banks first on every replay, so no state survives from one call to the next.

The graph is built with driver APIs once per expert-id dtype (each kernel walks one layer, so
no lag order and nothing else depends on ``num_tokens_bound``); a call writes its arguments
into the executable graph only when they differ from the last call's and then launches it:
new inputs written into the same arrays replay with no host work beyond the launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megamoe_rt.graph import split_tuning
from megamoe_rt.graph.builder import GraphBuilder, KernelNode
from megamoe_rt.graph.green import GreenPartitions, partition_granularity
from megamoe_rt.kernels import fused as fk
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.modes.base import Call, LayerSpec, LayoutNeeds, Mode, Weights, pool_memory_line
from megamoe_rt.modes.fused import BLOCK_M, GROUP_UNITS, CallSchedule, FusedMode, FusedPlan
from megamoe_rt.modes.peers import stage_inputs
from megamoe_rt.runtime import devices, kernel_launch, streams
from megamoe_rt.schedule.layout import BufferLayout
from megamoe_rt.schedule.plan import FusedSchedule, align_tokens, live_blocks_upper_bound, pool_blocks_upper_bound
from megamoe_rt.schedule.split_sms import SplitSms, check_split_sms, default_split_sms

# Each kernel walks one layer in pool order: no lag (the kernel never checks a single wave
# against the ring either, since K2 frees slots concurrently).
SPLIT_ORDER = CallSchedule(single_wave=False, lag_units=0, group_units=GROUP_UNITS)
# K2's grid barrier (across ranks, before it signals its partials) uses the second pair of
# grid_sync words; K1's routing barrier the first.
_K2_BARRIER_OFFSET = 8
# K3 blocks per SM at most (2048 threads): the rows a trace reserves for K3's blocks.
_REDUCE_BLOCKS_PER_SM = 2048 // fk.REDUCE_THREADS


def resolve_split_sms(spec: LayerSpec, granularity: int, requested: Any = None) -> tuple[SplitSms, str]:
    """The SM counts a split layer runs with and where they came from: the caller's, the
    tuning cache's for this device and shape, or the default rule."""
    total = spec.sm_count
    if requested is not None:
        return check_split_sms(requested, total, granularity), "given"
    key = split_tuning.shape_key(
        devices.device_info(spec.device).name,
        total,
        spec.hidden,
        spec.intermediate,
        spec.num_experts,
        spec.num_topk,
        spec.num_ranks,
    )
    tuned = split_tuning.lookup(key, spec.num_max_tokens_per_rank)
    if tuned is not None:
        try:
            return check_split_sms(tuned, total, granularity), "tuned"
        except (TypeError, ValueError):
            pass  # a stale entry (another driver's granularity): fall back to the rule
    return default_split_sms(total, granularity), "default"


@dataclass
class _SplitGraph:
    """One instantiated graph and the arguments last written into it."""

    builder: GraphBuilder
    k1: KernelNode
    k2: KernelNode
    k3: KernelNode
    args: tuple[bytes, bytes, bytes]


class SplitMode(FusedMode):
    """K1 and K2 concurrently in disjoint SM partitions, K3 after both, as one CUDA graph."""

    name = "split"

    @classmethod
    def refusal(cls, spec: LayerSpec) -> str | None:
        if spec.streaming is not None:
            return "streaming: runs in mode='fused' (one rank) or mode='unfused', not mode='split'"
        reason = super().refusal(spec)
        return reason.replace("mode='fused'", "mode='split'") if reason else None

    @classmethod
    def layout_needs(cls, spec: LayerSpec, ring_blocks: int | None = None) -> LayoutNeeds:
        # K1 may run ahead of K2 by the whole pool unless a ring is asked for.
        if ring_blocks is None:
            return LayoutNeeds(pool="full", block_m=BLOCK_M)
        return LayoutNeeds(pool="ring", block_m=BLOCK_M, ring_blocks=ring_blocks)

    @classmethod
    def minimum_ring_blocks(cls, spec: LayerSpec) -> int:
        """The blocks K1 may hold ahead of K2's reads (FusedSchedule's live window at lag 0), on
        the buffer's capacity (the spec's rounded up to the token granularity)."""
        full = pool_blocks_upper_bound(
            align_tokens(spec.num_max_tokens_per_rank), spec.num_ranks, spec.num_topk, spec.num_local_experts, BLOCK_M
        )
        return min(live_blocks_upper_bound(FusedSchedule(0, GROUP_UNITS, full, full)), full)

    def __init__(self, spec: LayerSpec, layout: BufferLayout):
        Mode.__init__(self, spec, layout)  # not FusedMode's: no lag-ordered schedules here
        full = pool_blocks_upper_bound(
            layout.num_max_tokens_per_rank, layout.num_ranks, layout.num_topk, layout.num_local_experts, BLOCK_M
        )
        # A ring must hold the blocks K1 keeps in flight (FusedSchedule refuses a smaller one).
        self.schedule = FusedSchedule(
            lag_units=0, group_units=GROUP_UNITS, ring_blocks=layout.pool_blocks, full_pool_blocks=full
        )
        self.plan: FusedPlan | None = None
        self.params_transforms = ()
        self.sms: SplitSms | None = None
        self.sms_source = ""
        if spec.sm_count:  # on a device: refuse SM counts it cannot form before any allocation
            self.sms, self.sms_source = resolve_split_sms(spec, partition_granularity(spec.device), spec.split_sms)
        self.partitions: GreenPartitions | None = None
        self.reduce_partition: GreenPartitions | None = None
        self._graphs: dict[str, _SplitGraph] = {}

    # --- setup -----------------------------------------------------------------------------

    def load(self, weights: Weights) -> None:
        s = self.spec
        self.plan = self._make_plan(self.schedule, weights)
        if self.sms is None:
            self.sms, self.sms_source = resolve_split_sms(s, partition_granularity(s.device), s.split_sms)
        l1, l2, reduce = self.sms.as_tuple()
        k2_request: int | str = "rest" if l1 + l2 == s.sm_count else l2
        self.partitions = GreenPartitions([("k1", l1), ("k2", k2_request)], device=s.device)
        if reduce < s.sm_count:
            self.reduce_partition = GreenPartitions([("k3", reduce)], device=s.device)
        if s.expert_parallel:
            self._graph("int32")  # compiled and built now, not inside a peer's deadline

    def load_for_ids(self, idx: str) -> None:
        if self.plan is not None:
            self._graph(idx)

    def _reduce_kernel(self, idx: str) -> kernel_launch.LoadedKernel:
        return get_kernel(fk.reduce_spec(idx, self.spec.expert_parallel), self.spec.device)

    def _graph(self, idx: str) -> _SplitGraph:
        g = self._graphs.get(idx)
        if g is not None:
            return g
        plan, parts, sms = self.plan, self.partitions, self.sms
        assert plan is not None and parts is not None and sms is not None, "load before the first call"
        k1_kernel, k2_kernel = plan.kernel(idx, "split_l1"), plan.kernel(idx, "split_l2")
        k3_kernel = self._reduce_kernel(idx)
        # A placeholder call: the first run writes its own arguments before launching.
        p1, p2, p3 = self._launch_params(Call(0, 0, 0, 0, 0, 0, idx, 1))
        b = GraphBuilder()
        try:
            banks = plan.banks[0]
            reset = b.add_memset_u32(banks, 0, 2 * plan.bank.words)
            maps = plan.tensor_map_args
            threads, smem = (fk.NUM_THREADS,), plan.smem_bytes
            n1 = b.add_kernel(k1_kernel, (sms.l1,), threads, [p1, *maps], ctx=parts["k1"].ctx, deps=[reset], smem=smem)
            n2 = b.add_kernel(
                k2_kernel, (parts["k2"].sm_count,), threads, [p2, *maps], ctx=parts["k2"].ctx, deps=[reset], smem=smem
            )
            # K1 and K2 each wait on their own blocks (grid barriers, or K1's blocks for K2):
            # every block must be resident, which a cooperative launch guarantees.
            b.set_cooperative(n1)
            b.set_cooperative(n2)
            per_sm = min(k3_kernel.max_active_blocks_per_sm(fk.REDUCE_THREADS, 0), _REDUCE_BLOCKS_PER_SM)
            k3_ctx = self.reduce_partition["k3"].ctx if self.reduce_partition is not None else None
            n3 = b.add_kernel(
                k3_kernel, (sms.reduce * per_sm,), (fk.REDUCE_THREADS,), [p3], ctx=k3_ctx, deps=[n1, n2], smem=0
            )
            b.instantiate()
        except BaseException:
            b.close()
            raise
        g = self._graphs[idx] = _SplitGraph(b, n1, n2, n3, (bytes(p1), bytes(p2), bytes(p3)))
        return g

    # --- calls -----------------------------------------------------------------------------

    def _launch_params(self, call: Call) -> tuple[fk.FusedParams, fk.FusedParams, fk.FusedParams]:
        """K1's, K2's and K3's parameter structs for ``call``."""
        assert self.plan is not None, "launch before load"
        p1 = self.plan.params(self.moe_params(call), SPLIT_ORDER, timeout_s=self.spec.timeout_s)
        for transform in self.params_transforms:
            transform(p1)
        p2 = fk.FusedParams.from_buffer_copy(p1)
        p2.grid_barrier = p1.grid_barrier + _K2_BARRIER_OFFSET
        p3 = fk.FusedParams.from_buffer_copy(p1)
        if p1.trace and self.sms is not None:  # K2's blocks stamp the rows after K1's, K3's after K2's
            row_bytes = len(fk.TRACE_EVENTS) * 8
            p2.trace = p1.trace + self.sms.l1 * row_bytes
            p3.trace = p1.trace + (self.sms.l1 + self.sms.l2) * row_bytes
        return p1, p2, p3

    def trace_rows(self) -> int:
        """Rows of a trace buffer: K1's blocks, then K2's, then (at most) K3's."""
        assert self.sms is not None, "the split is chosen when the layer is built on a device"
        return self.sms.l1 + self.sms.l2 + self.sms.reduce * _REDUCE_BLOCKS_PER_SM

    def launch_params(self, call: Call) -> fk.FusedParams:
        """K1's parameter struct of one call (K2's differs in its grid barrier only)."""
        return self._launch_params(call)[0]

    def run(self, call: Call, stream: int) -> None:
        if self.spec.expert_parallel:
            stage_inputs(self.bound_buffer(), call.x, call.x_sf, call.num_tokens, stream)
        g = self._graph(call.idx)
        params = self._launch_params(call)
        raw = tuple(bytes(p) for p in params)
        if raw != g.args:
            maps = self.plan.tensor_map_args if self.plan is not None else []
            for node, p, old, new in zip((g.k1, g.k2, g.k3), params, g.args, raw):
                if old != new:
                    g.builder.update_kernel(node, [p, *maps] if node is not g.k3 else [p])
            g.args = raw  # type: ignore[assignment]
        if streams.stream_is_capturing(stream):
            g.builder.add_to_capture(stream)
        else:
            g.builder.launch(stream)

    # --- reports ---------------------------------------------------------------------------

    def memory_notes(self) -> str:
        sms = "chosen at load" if self.sms is None else f"{self.sms.as_tuple()} ({self.sms_source})"
        return pool_memory_line(self.spec, self.layout, "split") + f"\nsplit SMs (K1, K2, K3): {sms}"

    def close(self) -> None:
        for g in self._graphs.values():
            g.builder.close()
        self._graphs.clear()
        for parts in (self.partitions, self.reduce_partition):
            if parts is not None:
                parts.close()
        self.partitions = self.reduce_partition = None
        super().close()
