"""The unfused mode of :class:`~megamoe_rt.layer.MegaMoE`: separate kernels, full-size pools.

On one rank a call runs route counting -> block-aligned pool offsets -> dispatch into the
expert pool -> L1 grouped GEMM (SwiGLU / top-k weight / FP8 requant epilogue) -> L2 grouped
GEMM scattering bf16 rows to their combine slots -> combine. Across ranks the routing and
dispatch steps are the cross-rank kernels of cuda_src/ep/ep_unfused.cu (the protocol is
modelled in megamoe_rt/schedule/ep_protocol.py): inputs are copied into the symmetric ``x`` /
``x_sf`` regions, where the ranks owning this rank's experts pull them from, and L2 scatters
into the combine slots of the rank each row came from.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.kernels import ep as ek
from megamoe_rt.kernels import moe as mk
from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8, plan_grouped_gemm_swiglu_fp8
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.modes.base import Call, LayerSpec, LayoutNeeds, Mode, Weights
from megamoe_rt.modes.peers import stage_inputs
from megamoe_rt.runtime import driver
from megamoe_rt.runtime.buffer import LayerBuffer
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.schedule.layout import BufferLayout

POOL_ALIGN = 128  # expert ranges in the pool start on GEMM-tile boundaries


class UnfusedMode(Mode):
    """Separate kernels around two grouped-GEMM plans, on one rank or across ranks."""

    name = "unfused"

    @classmethod
    def layout_needs(cls, spec: LayerSpec, ring_blocks: int | None = None) -> LayoutNeeds:
        return LayoutNeeds(pool="full", block_m=POOL_ALIGN)

    @classmethod
    def refusal(cls, spec: LayerSpec) -> str | None:
        if spec.num_ranks > ek.MAX_RANKS:
            return f"group: {spec.num_ranks} ranks; mode='unfused' runs on at most {ek.MAX_RANKS}"
        return None

    def __init__(self, spec: LayerSpec, layout: BufferLayout):
        super().__init__(spec, layout)
        self.expert_parallel = spec.expert_parallel
        if self.expert_parallel and layout.num_experts > ek.MAX_EXPERTS:
            raise ValueError(f"num_experts={layout.num_experts}: at most {ek.MAX_EXPERTS} across ranks")

        # One rank: the received counts are this rank's own row of expert_recv_counts; across
        # ranks the receive step sums every source's counts per local expert.
        self.counts_region = "ep_expert_totals" if self.expert_parallel else "expert_recv_counts"
        self.gemms: tuple[Any, Any] | None = None
        self._moe_kernels: dict[str, dict[str, Any]] = {}
        self._ep_kernels: dict[str, dict[str, Any]] = {}
        self._ep_fixed: dict[str, Any] = {}

    def bind(self, buffer: LayerBuffer, *, expert_recv_stats: int = 0, error_report: int = 0) -> None:
        super().bind(buffer, expert_recv_stats=expert_recv_stats, error_report=error_report)
        b, lay = buffer, self.layout
        self._recv_counts = b.ptr("expert_recv_counts")
        if self.expert_parallel:
            ws = lay.region("workspace").offset
            self._send_counts, self._send_cursors = b.ptr("ep_send_counts"), b.ptr("ep_send_cursors")
            # Every field of EpParams but the call's MoeParams and wait context.
            self._ep_fixed = dict(
                peer_bases=b.ptr("peer_bases"),
                off_x=lay.region("x").offset,
                off_x_sf=lay.region("x_sf").offset,
                off_send_list=lay.region("send_list").offset,
                off_combine=lay.region("combine").offset,
                off_banks=ws + lay.workspace_region("ep_banks").offset,
                send_counts=self._send_counts,
                send_offsets=b.ptr("ep_send_offsets"),
                send_cursors=self._send_cursors,
                send_list=b.ptr("send_list"),
                src_rows=b.ptr("ep_src_rows"),
                banks=b.ptr("ep_banks"),
                bank=ek.bank_layout(self.spec.num_ranks, lay.num_local_experts),
                launch_epoch=b.ptr("launch_epoch"),
                rank=self.spec.rank,
                num_ranks=self.spec.num_ranks,
            )

    def load(self, weights: Weights) -> None:
        b, s = self.bound_buffer(), self.spec
        common = dict(
            group_offsets=b.view("expert_pool_offsets"),
            group_counts=b.view(self.counts_region).reshape(-1),
            check_layout=False,
            a_sf_kmajor=True,
            stream=0,
        )
        l1 = plan_grouped_gemm_swiglu_fp8(
            b.view("l1_pool"),
            b.view("l1_pool_sf"),
            weights.w1p,
            weights.w1p_sf,
            b.view("l1_pool_weight"),
            act_sf_gran=s.act_sf_gran,
            swiglu_limit=s.swiglu_limit,
            pow2_scale=s.pow2_scale,
            out=b.view("l2_pool"),
            out_sf=b.view("l2_pool_sf"),
            **common,
        )
        l2 = plan_grouped_gemm_fp8(
            b.view("l2_pool"), b.view("l2_pool_sf"), weights.w2, weights.w2_sf, row_dst=b.view("l1_pool_dst"), **common
        )
        self.gemms = (l1, l2)
        if self.expert_parallel:
            self.ep_kernels("int32")  # int64 ids load at their first call
            self.moe_kernels("int32")

    def moe_kernels(self, idx: str) -> dict[str, Any]:
        """Routing, dispatch and combine kernels for ``idx`` ids (across ranks only the combine)."""
        if idx not in self._moe_kernels:
            specs = {"combine": mk.combine_spec(idx)}
            if not self.expert_parallel:
                specs.update(count=mk.count_spec(idx), offsets=mk.offsets_spec(), dispatch=mk.dispatch_spec(idx))
            self._moe_kernels[idx] = {k: get_kernel(spec, self.spec.device) for k, spec in specs.items()}
        return self._moe_kernels[idx]

    def ep_kernels(self, idx: str) -> dict[str, Any]:
        if idx not in self._ep_kernels:
            self._ep_kernels[idx] = {k: get_kernel(s, self.spec.device) for k, s in ek.specs(idx).items()}
        return self._ep_kernels[idx]

    def run(self, call: Call, stream: int) -> None:
        moe = self.moe_params(call)
        assert self.gemms is not None, "run before load"
        l1, l2 = self.gemms
        s, t = self.spec, call.num_tokens
        if not self.expert_parallel:
            kernels = self.moe_kernels(call.idx)
            grid = mk.grids(t, s.num_topk, s.sm_count)
            driver.memset_d32_async(self._recv_counts, 0, s.num_local_experts, stream)
            mk.launch_route_dispatch(kernels, moe, grid, stream)
            l1.run(stream)
            l2.run(stream)
            mk.launch_combine(kernels, moe, grid, stream)
            return
        params = ek.EpParams(moe=moe, wait=TimeoutRecord.get().context(s.timeout_s, rank=s.rank), **self._ep_fixed)
        kernels = self.ep_kernels(call.idx)
        stage_inputs(self.bound_buffer(), call.x, call.x_sf, t, stream)
        driver.memset_d32_async(self._send_counts, 0, s.num_experts, stream)
        driver.memset_d32_async(self._send_cursors, 0, s.num_experts, stream)
        ek.launch_before_gemms(
            kernels, params, pairs=t * s.num_topk, pool_rows=self.layout.pool_rows, sm_count=s.sm_count, stream=stream
        )
        l1.run(stream)
        l2.run(stream)
        ek.launch_finish(kernels, params, stream)
        if t:  # across ranks a rank without tokens still serves its experts, but combines nothing
            mk.launch_combine(self.moe_kernels(call.idx), moe, mk.grids(t, s.num_topk, s.sm_count), stream)

    def close(self) -> None:
        self.gemms = None
        super().close()
