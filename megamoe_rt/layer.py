"""``MegaMoE``: one expert-parallel FP8 MoE FFN layer (one rank).

A call runs on one stream with no host synchronisation between its steps (routing, dispatch,
L1 GEMM + SwiGLU + FP8 requant, L2 GEMM, slot-order combine), so it can be captured in a CUDA
graph and replayed with new inputs written into the same arrays.

How the steps are launched is the job of the layer's execution mode (megamoe_rt/modes/).
The layer is a facade over one concern per module: construction (layer_setup.py), a call's
argument checks (layer_calls.py), the weights (layer_weights.py) and the device's reports
(layer_reports.py); docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.ep.group import RankGroup
from megamoe_rt.layer_arguments import AGREED_LAYER_SETTINGS as AGREED_LAYER_SETTINGS
from megamoe_rt.layer_arguments import RANK_LOCAL_PARAMETERS as RANK_LOCAL_PARAMETERS
from megamoe_rt.layer_arguments import RANK_LOCAL_SPEC_FIELDS as RANK_LOCAL_SPEC_FIELDS
from megamoe_rt.layer_arguments import agreed_settings as agreed_settings
from megamoe_rt.layer_calls import CallChecks
from megamoe_rt.layer_reports import describe_findings as describe_findings
from megamoe_rt.layer_setup import set_up_rank
from megamoe_rt.layer_weights import WEIGHT_NAMES, copy_weights, device_weights, weight_shapes
from megamoe_rt.modes.base import Call, Weights
from megamoe_rt.modes.registry import mode_names
from megamoe_rt.modes.sizing import token_window_note
from megamoe_rt.runtime import streams
from megamoe_rt.schedule.streaming import StreamConfig

# The names of the execution modes (megamoe_rt.modes.registry.MODES maps them to their classes).
MODES = mode_names()


class MegaMoE:
    """One MoE FFN layer.

    Parameters (each in full: docs/USAGE.md, "Every argument of MegaMoE")
    ----------
    hidden, intermediate: model dimensions (multiples of 128).
    num_experts, num_topk: experts of the layer (across ranks split evenly), experts per token (<= 32).
    num_max_tokens_per_rank: token capacity of a call; buffers are sized for it.
    swiglu_limit: optional clamp (gate <= limit, |up| <= limit) before SwiGLU.
    act_sf_gran: 64 or 128, the requant group of the intermediate activation.
    pow2_scale: round intermediate scales up to powers of two (UE8M0-style callers).
    track_expert_stats: keep ``expert_recv_stats`` (int32 ``[E_local]``): pairs each expert received.
    validate_ids: raise ``DeviceInputError`` for expert ids the device refused (False: drop them).
    debug: wait for every call and raise what it reported before returning.
    mode: ``"fused"`` (one persistent launch, ring pools; the default where the shape allows
        it), ``"unfused"`` (separate kernels) or ``"split"`` (K1 and K2 side by side in
        green-context SM partitions, one CUDA graph per call); all bitwise equal.
    ring_blocks, chunk_ratio: the pool as a ring of this many blocks, or this share of the
        worst-case pool (``"auto"``: what half the free memory holds).
    split_sms: split: ``(l1, l2, reduce)`` SMs of K1, K2 and K3 (default: the tuned split).
    timeout_s: deadline of every device wait (``$MEGAMOE_RT_TIMEOUT_S`` or 60 s): a wait past it traps.
    group: a ``megamoe_rt.ep.launch.RankContext``: run expert-parallel across its ranks, the
        buffer on the NVSHMEM symmetric heap; every rank constructs the layer and makes every call.
    streaming: a ``StreamConfig``: an input ring producers publish token chunks into, run by
        :meth:`consume` as they arrive (``megamoe_rt.streaming`` has the producer side).
    transport: across ranks ``"nvlink"`` (peer mappings), ``"nvshmem"`` (NVSHMEM's device
        API; unfused only) or ``"auto"`` (nvlink where every rank maps every other).
    token_window: size the whole buffer for this many tokens per rank and run a longer call
        window by window, bit for bit the same output (docs/PREFILL.md).

    ``mode`` is the mode's name; ``runner`` the mode object (megamoe_rt/modes/) that launches calls.
    Errors found on the device (refused expert ids) are raised without making a call wait, by
    the next call, :meth:`check` or :meth:`synchronize`; across ranks a call, :meth:`check`,
    :meth:`synchronize` and construction are collectives that every rank passes or every rank
    raises alike (docs/USAGE.md, "Errors found on the device" and "Across ranks").
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        num_topk: int,
        num_max_tokens_per_rank: int,
        *,
        swiglu_limit: float | None = None,
        act_sf_gran: int = 128,
        pow2_scale: bool = False,
        track_expert_stats: bool = False,
        validate_ids: bool = True,
        debug: bool = False,
        device: int | None = None,
        mode: str | None = None,
        ring_blocks: int | None = None,
        chunk_ratio: float | str | None = None,
        split_sms: Any = None,
        timeout_s: float | None = None,
        group: RankGroup | None = None,
        streaming: StreamConfig | None = None,
        transport: str = "auto",
        token_window: int | None = None,
    ):
        self._closed = False
        rank = set_up_rank(
            (hidden, intermediate, num_experts, num_topk, num_max_tokens_per_rank),
            group=group,
            device=device,
            track_expert_stats=track_expert_stats,
            swiglu_limit=swiglu_limit,
            act_sf_gran=act_sf_gran,
            pow2_scale=pow2_scale,
            validate_ids=validate_ids,
            debug=debug,
            mode=mode,
            ring_blocks=ring_blocks,
            chunk_ratio=chunk_ratio,
            split_sms=split_sms,
            timeout_s=timeout_s,
            streaming=streaming,
            transport=transport,
            token_window=token_window,
        )
        spec = rank.spec
        self.hidden, self.intermediate = spec.hidden, spec.intermediate
        self.num_experts, self.num_topk = spec.num_experts, spec.num_topk
        self.num_max_tokens_per_rank = rank.given.capacity
        # Tokens per window when calls run in windows (the buffer's token capacity), else None.
        self.token_window = spec.num_max_tokens_per_rank if rank.given.windowed else None
        self.device_info, self.device = rank.device_info, rank.device_info.ordinal
        self.transport, self.timeout_s, self.debug = spec.transport, spec.timeout_s, spec.debug
        self.swiglu_limit, self.act_sf_gran, self.pow2_scale = spec.swiglu_limit, spec.act_sf_gran, spec.pow2_scale
        self.validate_ids, self.streaming = rank.given.validate_ids, spec.streaming
        self.group, self.num_ranks, self.rank = rank.group, spec.num_ranks, rank.rank
        self.num_local_experts, self.first_local_expert = spec.num_local_experts, spec.first_local_expert
        self.runner, self.mode, self.layout, self.buffer = rank.runner, rank.runner.name, rank.layout, rank.buffer
        self.expert_recv_stats, self._reports = rank.expert_recv_stats, rank.reports
        self._checks = CallChecks(self.hidden, self.num_topk, self.num_max_tokens_per_rank, self.device)
        self._weights: Weights | None = None

    # --- weights -------------------------------------------------------------------------

    def load_weights(self, w1: Any, w1_sf: Any, w2: Any, w2_sf: Any, *, stream: Any = None) -> None:
        """Take this rank's experts' weights in their plain layout (docs/NUMERICS.md; NumPy or any
        CUDA array; e4m3 as ml_dtypes or uint8): ``w1`` ``[E, 2I, H]`` (gate rows then up rows),
        ``w1_sf`` ``[E, 2I/128, H/128]``, ``w2`` ``[E, H, I]``, ``w2_sf`` ``[E, H/128, I/128]``.

        The layer keeps its own copies, made on ``stream`` (default: CuPy's current one; a call
        on another stream must be ordered after it). The first load builds the mode's plans and,
        across ranks, loads the kernels (no rank compiles inside a peer's deadline); a later one
        copies into the same arrays, so plans and captured graphs read the new weights from
        their next call on (a call still running on another stream must finish first)."""
        self._check_usable(weights=False)
        sh = streams.stream_handle(stream)
        shapes = weight_shapes(self.num_local_experts, self.hidden, self.intermediate)
        fresh = device_weights(dict(zip(WEIGHT_NAMES, (w1, w1_sf, w2, w2_sf))), shapes, self.device, sh)
        if self._weights is None:
            self.runner.load(fresh)
            self._weights = fresh
        else:
            copy_weights(self._weights, fresh, self.device, sh)  # same addresses: plans and graphs stay valid

    # --- call ----------------------------------------------------------------------------

    def __call__(
        self,
        x: Any,
        x_sf: Any,
        topk_idx: Any,
        topk_weights: Any,
        *,
        out: Any = None,
        stream: Any = None,
        num_tokens_bound: int | None = None,
    ):
        """Run the layer; returns ``y`` (bf16 bits as uint16, ``[T, H]``).

        ``x`` e4m3 (uint8) ``[T, H]``, ``x_sf`` float32 ``[T, H/128]``, ``topk_idx`` int32/int64
        ``[T, K]`` (global expert ids, -1 = empty), ``topk_weights`` float32 ``[T, K]``; ready on
        ``stream``. ``out`` (default: a new array) must not share memory with an input. A layer
        owns one buffer: calls must be ordered (one stream, or streams ordered with events).
        ``num_tokens_bound`` (``T`` up to the capacity, the default; across ranks the same on
        every rank): the most tokens any rank's call has, which sizes the fused order, the
        unfused ring's cycles and the token windows run."""

        def prepare(sh: int) -> tuple[Call, Any]:
            call, y = self._checks.batch(x, x_sf, topk_idx, topk_weights, out, sh, num_tokens_bound)
            self.runner.load_for_ids(call.idx)  # before the ranks' exchange: no compile inside a deadline
            return call, y

        return self._run_call(prepare, stream, self._run_windows)

    def _run_windows(self, call: Call, sh: int) -> None:
        """``call`` as the runner's calls, one per token window; across ranks every rank runs
        every window of the agreed bound (a rank without tokens still serves its experts)."""
        for window in call.windows(self.token_window, hidden=self.hidden, num_topk=self.num_topk):
            if window.num_tokens or self.group is not None:
                self.runner.run(window, sh)

    def _run_call(self, prepare, stream, run):
        """The one path of ``__call__`` and ``consume``: ``prepare(stream)`` checks the call and
        gives it and its output, ``run(call, stream)`` enqueues it. Reports of earlier calls are
        raised first (across ranks agreed: all launch or all raise), never while capturing."""
        capturing, local, call, y = False, None, None, None
        try:
            self._check_usable()
            sh = streams.stream_handle(stream)
            ask = self.group is not None or self.debug or self._reports.pending()  # else capture is moot
            capturing = ask and streams.stream_is_capturing(sh)
            if self.group is None and not capturing:
                self._reports.raise_pending(wait=False)
            call, y = prepare(sh)
        except Exception as exc:
            if self.group is None:
                raise
            local = exc  # every rank must learn of it before any launches
        raise_reports = not capturing
        if self.group is not None:
            bound = None if call is None else call.bound
            raise_reports = self._reports.agree_on_call(bound, capturing=capturing, local=local)
        run(call, sh)
        if self.debug and raise_reports:
            if self.group is None:
                streams.synchronize_stream(sh)
                self._reports.raise_pending(wait=False)
            else:
                self._reports.raise_across_ranks()
        return y

    # --- streamed calls ------------------------------------------------------------------

    @property
    def input_ring(self) -> Any:
        """The input ring (``streaming=``; its ``descriptor`` goes to producer kernels), or None."""
        return self.runner.input_ring

    def consume(self, num_tokens: int, *, out: Any = None, stream: Any = None, num_tokens_bound: int | None = None):
        """Run the layer on ``num_tokens`` tokens producers publish into the input ring
        (``streaming=``) chunk by chunk: chunk c, tokens ``[c * tokens_per_slot, ...)``, is read
        from slot ``c % num_slots`` once both its halves carry this call's generation. Returns
        ``y`` (bf16 bits, ``[num_tokens, H]``); no host synchronisation. ``num_tokens_bound``
        as for a call. Producers must be able to run while the layer waits (another stream, or
        enqueued before this call: docs/STREAMING.md, "Progress"); a chunk never published
        traps after the deadline, naming the slot and the generation waited for."""
        if self.streaming is None:
            raise RuntimeError("MegaMoE.consume: the layer was built without streaming=StreamConfig(...)")

        def prepare(sh: int) -> tuple[Call, Any]:
            return self._checks.streamed(num_tokens, out, sh, num_tokens_bound)

        return self._run_call(prepare, stream, self.runner.run_streamed)

    def _check_usable(self, *, weights: bool = True) -> None:
        if self._closed:
            raise RuntimeError("MegaMoE: the layer was closed")
        if weights and self._weights is None:
            raise RuntimeError("MegaMoE: call load_weights(w1, w1_sf, w2, w2_sf) before running the layer")

    # --- errors found on the device ------------------------------------------------------

    def check(self) -> None:
        """Raise what the device reported about earlier calls' inputs (``DeviceInputError``),
        waiting for the device only when a report is there (across ranks a collective)."""
        self._raise_reported(key="check", wait=False)

    def synchronize(self) -> None:
        """Wait for all work on the layer's device, then raise like :meth:`check` (a collective)."""
        self._raise_reported(key="synchronize", wait=True)

    def _raise_reported(self, *, key: str, wait: bool) -> None:
        if self.group is None:
            self._check_usable(weights=False)
            self._reports.raise_pending(wait=wait)
            return
        closed = RuntimeError("MegaMoE: the layer was closed") if self._closed else None
        if self._reports.agree_pending(key=key, closed_error=closed) or wait:
            self._reports.raise_across_ranks()

    # --- reports -------------------------------------------------------------------------

    def memory_report(self) -> str:
        """Per-region MiB of the buffer, then the mode's notes (ring and token window against none)."""
        notes = [self.layout.format_report(), self.runner.memory_notes()]
        if self.token_window is not None:
            notes.append(token_window_note(self.runner, self.num_max_tokens_per_rank, self.token_window))
        return "\n".join(filter(None, notes))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the buffer is released)."""
        return self._closed

    def close(self) -> None:
        """Release the buffer once this rank's work is done; across ranks every rank calls it."""
        if self._closed:
            return
        self._closed = True
        self._weights = None
        self.runner.close()
        self.buffer.close()
        self._reports.close()

    def flops(self, num_pairs: int) -> float:
        """Useful FLOPs of a call with ``num_pairs`` routed (token, slot) pairs."""
        return 2.0 * num_pairs * self.hidden * 2 * self.intermediate + 2.0 * num_pairs * self.intermediate * self.hidden
