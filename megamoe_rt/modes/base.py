"""What an execution mode of :class:`~megamoe_rt.layer.MegaMoE` is.

The layer checks its arguments, owns the weights and the buffer, validates each call's inputs
and hands everything else to one mode object. A mode says which buffer layout it needs, checks
that layout when it is created (before any memory is allocated), is bound to the allocated
buffer once, builds its plans and kernels from the weights, and enqueues calls. Adding a mode
is a subclass of :class:`Mode` plus its name and class in :mod:`megamoe_rt.modes.registry`.

Life of a mode object, driven by the layer:

1. ``cls.refusal(spec)`` (may this shape run here at all?) and ``cls.layout_needs(spec, ring_blocks)``;
   the layer computes the :class:`BufferLayout` once from those needs;
2. ``mode = cls(spec, layout)``: host-only checks of the layout (no device work);
3. ``mode.bind(buffer, expert_recv_stats=ptr, error_report=ptr)`` once the buffer exists;
4. ``mode.load(weights)``: plans, tensor maps, kernels;
5. ``mode.run(call, stream)`` per call; ``mode.memory_notes()`` for the memory report;
6. ``mode.close()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, cast

from megamoe_rt.kernels import moe as mk
from megamoe_rt.kernels.stream import InputRing
from megamoe_rt.modes.peers import write_peer_table
from megamoe_rt.runtime.buffer import LayerBuffer, SymmetricLayerBuffer
from megamoe_rt.schedule.layout import BufferLayout, symm_buffer_layout
from megamoe_rt.schedule.streaming import StreamConfig
from megamoe_rt.schedule.token_windows import token_windows


@dataclass(frozen=True)
class LayerSpec:
    """Everything about a layer a mode may depend on, fixed at construction.

    ``device`` and ``sm_count`` are those of the GPU the layer runs on (0 where a mode is
    only being checked, without a GPU)."""

    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    num_max_tokens_per_rank: int
    num_ranks: int = 1
    rank: int = 0
    act_sf_gran: int = 128
    swiglu_limit: float | None = None
    pow2_scale: bool = False
    debug: bool = False
    timeout_s: float | None = None
    device: int = 0
    sm_count: int = 0
    split_sms: Any = None  # split: (K1, K2, K3) SM counts or a SplitSms; None: tuned or default
    streaming: StreamConfig | None = None  # the chunk-ready input ring, if any
    transport: str = "nvlink"  # across ranks: "nvlink" (peer pointers) or "nvshmem" (device API)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def first_local_expert(self) -> int:
        return self.rank * self.num_local_experts

    @property
    def expert_parallel(self) -> bool:
        return self.num_ranks > 1


TRANSPORT_CHOICES = ("auto", "nvlink", "nvshmem")


def check_transport(transport: Any, num_ranks: int) -> str:
    """``MegaMoE(transport=...)``: how the layer reaches other ranks. ``"nvlink"``: loads and
    stores through the peers' mappings of the symmetric buffer (one node); ``"nvshmem"``:
    NVSHMEM's device API (any transport NVSHMEM has; mode='unfused'); ``"auto"``: "nvlink"
    where every rank maps every other, else "nvshmem" (decided with the other ranks)."""
    if not isinstance(transport, str) or transport not in TRANSPORT_CHOICES:
        raise ValueError(f"transport: expected one of {TRANSPORT_CHOICES}, got {transport!r}")
    if transport == "nvshmem" and num_ranks == 1:
        raise ValueError("transport='nvshmem': a layer without group= (one rank) has no other rank to reach")
    return transport


@dataclass(frozen=True)
class LayoutNeeds:
    """The buffer a mode runs on: pool kind (``"full"`` or ``"ring"``), the row granularity
    of expert ranges in the pool, and the ring size (None: the layout's default)."""

    pool: str
    block_m: int
    ring_blocks: int | None = None


def buffer_layout(spec: LayerSpec, needs: LayoutNeeds) -> BufferLayout:
    """The layer's buffer layout for a mode's needs (computed once per layer)."""
    return symm_buffer_layout(
        spec.hidden,
        spec.intermediate,
        spec.num_experts,
        spec.num_topk,
        spec.num_max_tokens_per_rank,
        spec.num_ranks,
        block_m=needs.block_m,
        act_sf_gran=spec.act_sf_gran,
        pool=needs.pool,
        ring_blocks=needs.ring_blocks,
        stream_slots=spec.streaming.num_slots if spec.streaming else 0,
        stream_tokens=spec.streaming.tokens_per_slot if spec.streaming else 0,
        ep_staging=spec.expert_parallel and spec.transport == "nvshmem",
    )


POOL_REGIONS = ("l1_pool", "l1_pool_sf", "l2_pool", "l2_pool_sf")


def pool_memory_line(spec: LayerSpec, layout: BufferLayout, mode: str) -> str:
    """One line of the memory report: the pools' blocks and MiB against the full worst-case
    pool's, and the whole buffer against the one a full pool would need."""
    full = buffer_layout(spec, LayoutNeeds(pool="full", block_m=layout.block_m))
    pool_b = sum(layout.region(n).nbytes for n in POOL_REGIONS)
    full_b = sum(full.region(n).nbytes for n in POOL_REGIONS)
    pools = f"{mode} pools: %s of {layout.pool_blocks} blocks x {layout.block_m} rows = {pool_b / 2**20:.2f} MiB"
    if layout.pool_blocks >= full.pool_blocks:
        return pools % "full pool"
    return pools % "ring" + (
        f" vs full pool of {full.pool_blocks} blocks = {full_b / 2**20:.2f} MiB; "
        f"buffer {layout.total_bytes / 2**20:.2f} MiB vs {full.total_bytes / 2**20:.2f} MiB"
    )


class Weights(NamedTuple):
    """The layer's weights on the device, re-laid for the kernels: ``w1p`` / ``w1p_sf`` with gate
    and up rows interleaved for the SwiGLU epilogue, ``w2`` / ``w2_sf`` as given."""

    w1p: Any
    w1p_sf: Any
    w2: Any
    w2_sf: Any


class Call(NamedTuple):
    """One validated call: device addresses of its arrays, its token count, the dtype of its
    expert ids (``"int32"`` or ``"int64"``) and its ``num_tokens_bound``. ``token_base``: the
    index of its token 0 in the caller's call (a token window's first token), so reports of
    refused inputs name the caller's tokens."""

    x: int
    x_sf: int
    topk_idx: int
    topk_weights: int
    y: int
    num_tokens: int
    idx: str
    bound: int
    token_base: int = 0

    def window(self, first: int, num_tokens: int, bound: int, *, hidden: int, num_topk: int) -> Call:
        """The call over its tokens ``[first, first + num_tokens)`` with ``bound`` (a token
        window, megamoe_rt/schedule/token_windows.py): every address moved to token ``first``."""
        idx_bytes = 8 if self.idx == "int64" else 4
        return Call(
            self.x + first * hidden,
            self.x_sf + first * (hidden // 128) * 4,
            self.topk_idx + first * num_topk * idx_bytes,
            self.topk_weights + first * num_topk * 4,
            self.y + first * hidden * 2,
            num_tokens,
            self.idx,
            bound,
            self.token_base + first,
        )

    def windows(self, window: int | None, *, hidden: int, num_topk: int) -> list[Call]:
        """The calls this call runs as: itself (``window`` None), or one per token window of
        ``window`` tokens (megamoe_rt/schedule/token_windows.py)."""
        if window is None:
            return [self]
        return [
            self.window(w.first, w.num_tokens, w.bound, hidden=hidden, num_topk=num_topk)
            for w in token_windows(self.num_tokens, self.bound, window)
        ]


class Mode(ABC):
    """One execution mode of the layer (see the module docstring for its life cycle)."""

    name: ClassVar[str]
    # Whether the default picks this mode for a streamed layer (``streaming=``) it runs, and
    # whether it streams over a ring pool (``ring_blocks`` / ``chunk_ratio``).
    streams_by_default: ClassVar[bool] = True
    streams_over_ring: ClassVar[bool] = True

    @classmethod
    def refusal(cls, spec: LayerSpec) -> str | None:
        """Why this mode cannot run ``spec`` (the error message), or None. A mode asked for by
        name raises it; the default picks the first mode without one."""
        return None

    @classmethod
    @abstractmethod
    def layout_needs(cls, spec: LayerSpec, ring_blocks: int | None = None) -> LayoutNeeds:
        """The buffer this mode runs ``spec`` on."""

    @classmethod
    def minimum_ring_blocks(cls, spec: LayerSpec) -> int:
        """The smallest ring (``ring_blocks``) this mode runs ``spec`` on."""
        return 1

    def __init__(self, spec: LayerSpec, layout: BufferLayout):
        self.spec = spec
        self.layout = layout
        self.buffer: LayerBuffer | None = None
        self._moe_fixed: dict[str, int] = {}

    # The chunk-ready input ring (spec.streaming), once bound.
    input_ring: InputRing | None = None

    # The workspace region the MoE kernels read per-expert received counts from.
    counts_region: str = "expert_recv_counts"

    def bind(self, buffer: LayerBuffer, *, expert_recv_stats: int = 0, error_report: int = 0) -> None:
        """Attach the layer's buffer (laid out by ``self.layout``): resolve every address a call
        uses, and across ranks write the peer table. ``expert_recv_stats``: device address of the
        layer's statistics array; ``error_report``: device address of the layer's
        :class:`~megamoe_rt.runtime.error_report.ErrorReport` (0: none for either)."""
        self.buffer = b = buffer
        s, lay = self.spec, self.layout
        # Everything of MoeParams that does not change between calls, resolved once.
        self._moe_fixed = dict(
            num_topk=s.num_topk,
            hidden=s.hidden,
            num_experts=s.num_experts,
            num_local_experts=s.num_local_experts,
            first_local_expert=s.first_local_expert,
            pool_rows=lay.pool_rows,
            pool_row_limit=lay.full_pool_rows,
            pool_cycles=b.ptr("pool_cycles"),
            pool_align=lay.block_m,
            token_capacity=lay.num_max_tokens_per_rank,
            expert_counts=b.ptr(self.counts_region),
            expert_offsets=b.ptr("expert_pool_offsets"),
            expert_cursors=b.ptr("expert_cursors"),
            expert_recv_stats=int(expert_recv_stats),
            errors=int(error_report),
            pool=b.ptr("l1_pool"),
            pool_sf=b.ptr("l1_pool_sf"),
            pool_src=b.ptr("l1_pool_src"),
            pool_weight=b.ptr("l1_pool_weight"),
            pool_dst=b.ptr("l1_pool_dst"),
            combine=b.ptr("combine"),
        )
        if s.streaming is not None:
            self.input_ring = InputRing(buffer, lay, device=s.device, timeout_s=s.timeout_s, rank=s.rank)
        if s.expert_parallel:
            write_peer_table(cast(SymmetricLayerBuffer, buffer))  # expert-parallel layers bind symmetric buffers

    def bound_buffer(self) -> LayerBuffer:
        """The buffer :meth:`bind` attached (loads and calls only happen after it)."""
        assert self.buffer is not None, "the mode is not bound to a buffer"
        return self.buffer

    def moe_params(self, call: Call) -> mk.MoeParams:
        """The routing / dispatch / combine parameters of one call."""
        return mk.MoeParams(
            topk_idx=call.topk_idx,
            topk_weights=call.topk_weights,
            x=call.x,
            x_sf=call.x_sf,
            num_tokens=call.num_tokens,
            y=call.y,
            token_base=call.token_base,
            **self._moe_fixed,
        )

    @abstractmethod
    def load(self, weights: Weights) -> None:
        """Build everything a call needs from the weights (plans, tensor maps); across ranks also
        compile and load the kernels, so no rank compiles into its peers' deadlines."""

    @abstractmethod
    def load_for_ids(self, idx: str) -> None:
        """Compile and load what a call with ``idx`` expert ids (``"int32"`` or ``"int64"``)
        launches, if not done yet. The layer calls it while it checks a call, before the ranks'
        exchange: a rank's first call with new ids compiles while its peers wait on the host,
        not inside a kernel's deadline, and no module is loaded between a call's launches."""

    @abstractmethod
    def run(self, call: Call, stream: int) -> None:
        """Enqueue one call on ``stream`` (no host synchronisation)."""

    def run_streamed(self, call: Call, stream: int) -> None:
        """Enqueue a call whose inputs come from the input ring, chunk by chunk (modes that
        support ``streaming=`` only)."""
        raise NotImplementedError(f"mode {self.name!r} does not run streamed calls")

    def memory_notes(self) -> str:
        """Lines the layer's memory report adds after the region table ("" for none)."""
        return ""

    def close(self) -> None:
        """Drop plans and kernels; the buffer is the layer's to free."""
        self.buffer = None
