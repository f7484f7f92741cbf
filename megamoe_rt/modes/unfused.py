"""The unfused mode of :class:`~megamoe_rt.layer.MegaMoE`: separate kernels, full-size pools
or a ring run in cycles.

On one rank a call runs route counting -> block-aligned pool offsets -> dispatch into the
expert pool -> L1 grouped GEMM (SwiGLU / top-k weight / FP8 requant epilogue) -> L2 grouped
GEMM scattering bf16 rows to their combine slots -> combine. Across ranks the routing and
dispatch steps are the cross-rank kernels of cuda_src/ep/ep_unfused.cu (the protocol is
modelled in megamoe_rt/schedule/ep_protocol.py): inputs are copied into the symmetric ``x`` /
``x_sf`` regions, where the ranks owning this rank's experts pull them from, and L2 scatters
into the combine slots of the rank each row came from.

With a ring (``ring_blocks`` / ``chunk_ratio``) the pool's data regions hold ``ring_blocks`` of
its blocks at a time and the call runs in cycles: cycle ``c`` fills the window of pool rows
``[c * ring_rows, (c + 1) * ring_rows)`` (one rank: the dispatch copies the first window while
it claims rows, ``moe_fill_window`` each later one; across ranks the pull runs per window), then
both GEMMs run over that window. Routing, per-row metadata and the combine buffer stay full
size. The host enqueues the cycles the worst-case pool at the call's ``num_tokens_bound`` needs
(the same on every rank); the device records the cycles the pool actually took in the
workspace word ``pool_cycles`` (across ranks the most of any rank).
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.graph.launches import GraphLaunches
from megamoe_rt.kernels import ep as ek
from megamoe_rt.kernels import moe as mk
from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8, plan_grouped_gemm_swiglu_fp8
from megamoe_rt.kernels.loader import get_kernel
from megamoe_rt.modes.base import Call, LayerSpec, LayoutNeeds, Mode, Weights, buffer_layout, pool_memory_line
from megamoe_rt.modes.peers import stage_inputs
from megamoe_rt.modes.stream_pool import StreamPool
from megamoe_rt.runtime.buffer import LayerBuffer
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.runtime.launches import Launches, StreamLaunches
from megamoe_rt.schedule.arith import ceil_div
from megamoe_rt.schedule.layout import BufferLayout
from megamoe_rt.schedule.plan import cycles_to_launch

POOL_ALIGN = 128  # expert ranges in the pool start on GEMM-tile boundaries
# A ring is at least 1/MAX_CYCLES of the worst-case pool: every cycle costs a few launches, and
# a cycle's GEMMs each pay a partial last wave.
MAX_CYCLES = 64


class UnfusedMode(Mode):
    """Separate kernels around two grouped-GEMM plans, on one rank or across ranks."""

    name = "unfused"

    @classmethod
    def layout_needs(cls, spec: LayerSpec, ring_blocks: int | None = None) -> LayoutNeeds:
        if ring_blocks is None:
            return LayoutNeeds(pool="full", block_m=POOL_ALIGN)
        return LayoutNeeds(pool="ring", block_m=POOL_ALIGN, ring_blocks=ring_blocks)

    @classmethod
    def minimum_ring_blocks(cls, spec: LayerSpec) -> int:
        full = buffer_layout(spec, LayoutNeeds(pool="full", block_m=POOL_ALIGN)).pool_blocks
        return max(1, ceil_div(full, MAX_CYCLES))

    @classmethod
    def refusal(cls, spec: LayerSpec) -> str | None:
        if spec.num_ranks > ek.MAX_RANKS:
            return f"group: {spec.num_ranks} ranks; mode='unfused' runs on at most {ek.MAX_RANKS}"
        return None

    def __init__(self, spec: LayerSpec, layout: BufferLayout):
        super().__init__(spec, layout)
        minimum = min(self.minimum_ring_blocks(spec), layout.full_pool_blocks)
        if layout.pool_blocks < minimum:
            raise ValueError(
                f"ring_blocks={layout.pool_blocks}: mode='unfused' runs a ring of at least {minimum} blocks of "
                f"{POOL_ALIGN} rows here (1/{MAX_CYCLES} of the worst-case pool of {layout.full_pool_blocks})"
            )
        # True when the pool's data regions are a ring smaller than the worst-case pool (fixed
        # with the layout; read on every call).
        self.ring = layout.pool_blocks < layout.full_pool_blocks
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
        self._fill_window: Any = None
        self._stream_pool: StreamPool | None = None  # one rank, full pool, streaming: bound in bind
        self._graphs: dict[tuple[str, int, bool], GraphLaunches] = {}

    def bind(self, buffer: LayerBuffer, *, expert_recv_stats: int = 0, error_report: int = 0) -> None:
        super().bind(buffer, expert_recv_stats=expert_recv_stats, error_report=error_report)
        b, lay = buffer, self.layout
        self._recv_counts = b.ptr("expert_recv_counts")
        if self.spec.streaming is not None and not self.expert_parallel and not self.ring:
            self._stream_pool = StreamPool(self.spec, lay, b)
        if self.expert_parallel:
            ws = lay.region("workspace").offset
            self._send_counts, self._send_cursors = b.ptr("ep_send_counts"), b.ptr("ep_send_cursors")
            # Every field of EpParams but the call's MoeParams and wait context.
            self._staged_inputs = (lay.region("x").offset, lay.region("x_sf").offset)
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
                staging=b.ptr("ep_staging") if self.spec.transport == "nvshmem" else 0,
            )

    def load(self, weights: Weights) -> None:
        b, s = self.bound_buffer(), self.spec
        common = dict(
            group_offsets=b.view("expert_pool_offsets"),
            group_counts=b.view(self.counts_region).reshape(-1),
            check_layout=False,
            a_sf_kmajor=True,
            stream=0,
            wait=TimeoutRecord.get().context(s.timeout_s, rank=s.rank),
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
            self.ep_kernels("int32")  # int64 ids: load_for_ids at their first call
            self.moe_kernels("int32")
            if self.input_ring is not None:
                self.input_ring.load_kernels()

    def load_for_ids(self, idx: str) -> None:
        if self.expert_parallel:
            self.ep_kernels(idx)  # across ranks the pull fills each window
        elif self.ring:
            self._fill_window_kernel()
        self.moe_kernels(idx)

    def moe_kernels(self, idx: str) -> dict[str, Any]:
        """Routing, dispatch and combine kernels for ``idx`` ids (across ranks only the combine)."""
        if idx not in self._moe_kernels:
            specs = {"combine": mk.combine_spec(idx)}
            if not self.expert_parallel:
                specs.update(count=mk.count_spec(idx), offsets=mk.offsets_spec(), dispatch=mk.dispatch_spec(idx))
            self._moe_kernels[idx] = {k: get_kernel(spec, self.spec.device) for k, spec in specs.items()}
        return self._moe_kernels[idx]

    def _fill_window_kernel(self) -> Any:
        if self._fill_window is None:
            self._fill_window = get_kernel(mk.fill_window_spec(), self.spec.device)
        return self._fill_window

    def ep_kernels(self, idx: str) -> dict[str, Any]:
        if idx not in self._ep_kernels:
            specs = ek.specs(idx, self.spec.transport)
            self._ep_kernels[idx] = {k: get_kernel(s, self.spec.device) for k, s in specs.items()}
        return self._ep_kernels[idx]

    def cycles_to_launch(self, bound: int) -> int:
        """Cycles a call bounded by ``bound`` tokens per rank enqueues (1 without a ring)."""
        if not self.ring:
            return 1
        s = self.spec
        return cycles_to_launch(
            bound, s.num_ranks, s.num_topk, s.num_local_experts, self.layout.pool_blocks, POOL_ALIGN
        )

    def _gemms_over_window(self, row_base: int, q: Launches) -> None:
        assert self.gemms is not None, "run before load"
        for gemm in self.gemms:
            gemm.enqueue_window(q, row_base)

    def run(self, call: Call, stream: int) -> None:
        if self.expert_parallel:
            stage_inputs(self.bound_buffer(), call.x, call.x_sf, call.num_tokens, stream)
            key, graph = self._call_graph(call)
            try:
                graph.begin()
                self._run_across_ranks(call, graph, self._staged_inputs)
                graph.end(stream)
            except BaseException:
                if graph.recording:  # half recorded: never replay it
                    self._graphs.pop(key, None)
                    graph.close()
                raise
        elif call.num_tokens:
            self._run_one_rank(call, StreamLaunches(stream))

    def _call_graph(self, call: Call) -> tuple[tuple[str, int, bool], GraphLaunches]:
        """The graph a call across ranks replays: one per launch sequence (id dtype, cycles,
        whether this rank has tokens). Across ranks a call is a dozen small launches whose host
        cost would exceed a small call's device time (graph/launches.py)."""
        key = (call.idx, self.cycles_to_launch(call.bound), call.num_tokens > 0)
        graph = self._graphs.get(key)
        if graph is None:
            self.ep_kernels(call.idx)  # loaded before recording: a lazy load mid-sequence would sync
            self.moe_kernels(call.idx)
            graph = self._graphs[key] = GraphLaunches(self.spec.device)
        return key, graph

    def _run_one_rank(self, call: Call, q: Launches) -> None:
        moe = self.moe_params(call)
        s, t = self.spec, call.num_tokens
        ring_rows = self.layout.pool_rows
        kernels = self.moe_kernels(call.idx)
        grid = mk.grids(t, s.num_topk, s.sm_count)
        q.memset_u32(self._recv_counts, 0, s.num_local_experts)
        mk.launch_route_dispatch(kernels, moe, grid, q)  # fills the first window
        for c in range(self.cycles_to_launch(call.bound)):
            if c:
                moe.row_base = c * ring_rows
                mk.launch_fill_window(self._fill_window_kernel(), moe, s.sm_count, q)
            self._gemms_over_window(c * ring_rows, q)
        mk.launch_combine(kernels, moe, grid, q)

    def _run_across_ranks(self, call: Call, q: Launches, inputs_at: tuple[int, int], wait: Any = None) -> None:
        """``inputs_at``: where every rank's x and x_sf rows of this call are, as byte offsets
        into the buffer (the same on every rank): the staging regions, or a ring slot. ``wait``:
        the waits' deadline context, when the caller resolved it once for several of these."""
        moe = self.moe_params(call)
        s, t = self.spec, call.num_tokens
        ring_rows = self.layout.pool_rows
        fixed = dict(self._ep_fixed, off_x=inputs_at[0], off_x_sf=inputs_at[1])
        if wait is None:
            wait = TimeoutRecord.get().context(s.timeout_s, rank=s.rank)
        params = ek.EpParams(moe=moe, wait=wait, **fixed)
        kernels = self.ep_kernels(call.idx)
        q.memset_u32(self._send_counts, 0, s.num_experts)
        q.memset_u32(self._send_cursors, 0, s.num_experts)
        ek.launch_routing(kernels, params, pairs=t * s.num_topk, sm_count=s.sm_count, q=q)
        for c in range(self.cycles_to_launch(call.bound)):
            params.moe.row_base = c * ring_rows
            ek.launch_pull(kernels, params, sm_count=s.sm_count, q=q)
            self._gemms_over_window(c * ring_rows, q)
            if s.transport == "nvshmem":  # the window's partials, staged by L2, to their ranks
                ek.launch_push(kernels, params, sm_count=s.sm_count, q=q)
        params.moe.row_base = 0
        ek.launch_finish(kernels, params, q)
        if t:  # across ranks a rank without tokens still serves its experts, but combines nothing
            mk.launch_combine(self.moe_kernels(call.idx), moe, mk.grids(t, s.num_topk, s.sm_count), q)

    def run_streamed(self, call: Call, stream: int) -> None:
        """A call whose inputs come from the input ring (``spec.streaming``). One rank with a
        full pool: through one call-wide pool (megamoe_rt/modes/stream_pool.py), each expert's
        weights read once. Otherwise chunk by chunk, each as a call of its own."""
        self._load_streamed_kernels(call.idx)
        if self._stream_pool is not None:
            assert self.gemms is not None, "run before load"
            self._stream_pool.run(self, call, self.gemms, stream)
        else:
            self._run_chunks(call, stream)

    def _run_chunks(self, call: Call, stream: int) -> None:
        """Every chunk as a call of its own on the chunk's slot, its output rows at the chunk's
        place in ``call.y``. ``call.bound`` (the same on every rank) sets the chunk count, so
        every rank runs the same chunks; a rank whose tokens end sooner serves its experts in
        the rest."""
        cfg = self.spec.streaming
        assert cfg is not None and self.input_ring is not None, "a streamed call needs the input ring"
        h, c_tokens = self.spec.hidden, cfg.tokens_per_slot
        ring = self.input_ring
        ring.begin_consume(stream)
        # Resolved once a call, not per chunk (it reads the deadline from the environment).
        wait = TimeoutRecord.get().context(self.spec.timeout_s, rank=self.spec.rank) if self.expert_parallel else None
        for chunk in range(cfg.num_chunks(call.bound)):
            n = cfg.chunk_tokens(call.num_tokens, chunk)
            slot = chunk % cfg.num_slots
            if n:
                ring.wait_chunk(chunk, stream)
            at = ring.slot_addresses(slot)
            y = call.y + chunk * c_tokens * h * 2
            part = Call(at.x, at.x_sf, at.topk_idx, at.topk_weights, y, n, "int32", c_tokens)
            if self.expert_parallel:
                self._run_across_ranks(part, StreamLaunches(stream), ring.slot_offsets(slot), wait)
            elif n:
                self._run_one_rank(part, StreamLaunches(stream))
            if n:  # across ranks after the chunk's closing barrier: every peer's pulls are done
                ring.release_chunk(chunk, stream)
        ring.note_consumer(stream)

    def _load_streamed_kernels(self, idx: str) -> None:
        """Every kernel a streamed call launches, loaded before its first chunk wait. Loading a
        module may synchronise the context (CUDA lazy loading): done between chunks, it would
        wait for the spinning chunk wait, which waits for a producer this thread has not yet
        launched."""
        assert self.input_ring is not None
        self.input_ring.load_kernels()
        self.moe_kernels(idx)
        if self.expert_parallel:
            self.ep_kernels(idx)
        elif self.ring:
            self._fill_window_kernel()
        if self._stream_pool is not None:
            self._stream_pool.load_kernels()

    def memory_notes(self) -> str:
        line = pool_memory_line(self.spec, self.layout, "unfused")
        if not self.ring:
            return line
        return line + f"; a call runs at most {self.cycles_to_launch(self.layout.num_max_tokens_per_rank)} cycles"

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        self.gemms = None
        super().close()
