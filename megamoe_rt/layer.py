"""``MegaMoE``: one expert-parallel FP8 MoE FFN layer (one rank).

A call runs, on one stream with no host synchronisation between the steps:
route counting -> block-aligned pool offsets -> dispatch into the expert pool ->
L1 grouped GEMM with the SwiGLU / top-k weight / FP8 requant epilogue -> L2 grouped
GEMM scattering bf16 rows to their combine slots -> combine (slot-order sum). The
whole call can therefore be captured in a CUDA graph and replayed with new inputs
written into the same arrays.

How the steps are launched is the job of the layer's execution mode (megamoe_rt/modes/):
``mode="unfused"`` runs them as separate kernels; ``mode="fused"`` runs them in one
persistent launch with both GEMMs in a lag task order and ring-sized pools;
``mode="split"`` runs dispatch + L1 and L2 + scatter as two kernels side by side in
green-context SM partitions and the reduce after them, as one CUDA graph. The
layer itself checks arguments, owns the weights and the buffer, validates each call's inputs
and hands the call to its mode object (:attr:`MegaMoE.runner`; docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from megamoe_rt.ep import agreement
from megamoe_rt.ep.group import RankGroup, check_group
from megamoe_rt.kernels.grouped_gemm import prepare_swiglu_weights
from megamoe_rt.layer_arguments import AGREED_LAYER_SETTINGS as AGREED_LAYER_SETTINGS
from megamoe_rt.layer_arguments import RANK_LOCAL_PARAMETERS as RANK_LOCAL_PARAMETERS
from megamoe_rt.layer_arguments import RANK_LOCAL_SPEC_FIELDS as RANK_LOCAL_SPEC_FIELDS
from megamoe_rt.layer_arguments import agreed_settings as agreed_settings
from megamoe_rt.layer_arguments import check_layer_arguments
from megamoe_rt.modes.base import Call, Weights, buffer_layout
from megamoe_rt.modes.registry import mode_names, select_mode
from megamoe_rt.modes.sizing import layer_layout
from megamoe_rt.runtime import args, driver
from megamoe_rt.runtime.arrays import as_device_array, check_array, check_disjoint, cupy_stream, require_cupy
from megamoe_rt.runtime.buffer import DeviceBuffer, LayerBuffer
from megamoe_rt.runtime.error_report import ErrorReport
from megamoe_rt.runtime.errors import DeviceInputError, Finding
from megamoe_rt.schedule.streaming import StreamConfig
from megamoe_rt.schedule.token_windows import num_windows, token_windows

# The names of the execution modes (megamoe_rt.modes.registry.MODES maps them to their classes).
MODES = mode_names()

# Report kinds about expert ids (the ones validate_ids=False leaves unraised).
_ID_ERRORS = ("expert_id_out_of_range", "repeated_expert_id")


def _agree_on_set_up(group: RankGroup, step: str, failure: BaseException | None) -> None:
    """Across ranks, after a step of construction that may fail on one rank only: every rank
    goes on, or every rank raises the failing rank's error (a collective)."""
    failed = agreement.gather_failures(group, f"MegaMoE set-up: {step}", failure)
    if failed:
        raise agreement.refusal(f"MegaMoE set-up ({step})", failed) from failure


def describe_findings(findings: tuple[Finding, ...], num_topk: int, num_experts: int, rank: int | None) -> str:
    """One message for the findings of a layer's report, naming the argument at fault
    (``rank``: the rank's number across ranks, else None)."""
    k, lines = num_topk, []
    for f in findings:
        token, slot = divmod(f.where, k)
        if f.kind == "expert_id_out_of_range":
            lines.append(
                f"topk_idx: expert id outside [-1, {num_experts}) "
                f"(e.g. topk_idx[{token}, {slot}] = {f.what_signed}); the slot was treated as empty"
            )
        elif f.kind == "repeated_expert_id":
            lines.append(
                f"topk_idx: expert repeated within a token's top-k (e.g. topk_idx[{token}, {slot}] "
                f"= {f.what_signed} repeats an earlier slot of token {token}); the later slot was dropped"
            )
        elif f.kind == "pool_overflow":
            lines.append(
                f"topk_idx: the routing needs {f.where} rows of the expert pool, the buffer holds {f.what}; "
                "the rows past it were not computed"
            )
        else:
            lines.append(f"{f.kind}: details {f.where}, {f.what}")
    where = "" if rank is None else f" (rank {rank})"
    return f"MegaMoE{where}: inputs refused on the device by an earlier call:\n  " + "\n  ".join(lines)


class MegaMoE:
    """One MoE FFN layer.

    Parameters
    ----------
    hidden, intermediate: model dimensions (multiples of 128).
    num_experts: experts of the layer (all local on one rank).
    num_topk: experts per token (at most 32).
    num_max_tokens_per_rank: token capacity of a call; buffers are sized for it.
    swiglu_limit: optional clamp (gate <= limit, |up| <= limit) before SwiGLU.
    act_sf_gran: 64 or 128, the requant group of the intermediate activation.
    pow2_scale: round intermediate scales up to powers of two (UE8M0-style callers).
    track_expert_stats: keep ``expert_recv_stats`` (int32 ``[E_local]``), increased on the
        device by every call with the (token, slot) pairs each local expert received.
    validate_ids: raise :class:`~megamoe_rt.runtime.error_report.DeviceInputError` for expert ids
        the device refused: outside ``[-1, num_experts)``, or naming an expert an earlier slot of
        the same token already names. The kernels check every id as they route it and treat a
        refused slot as empty, whatever this says; the check costs no host synchronisation,
        so the error comes later (see "Errors found on the device" below). False: refused
        slots are dropped silently.
    debug: wait for every call and raise what it reported before returning.
    mode: ``"fused"`` (one persistent launch, pools sized as rings around the lag-ordered
        schedule; needs hidden % 256 == 0) or ``"unfused"`` (separate kernels; the full
        worst-case pool, or a ring run in cycles).
        Default: fused where the shape allows it (it is faster on every benchmarked shape, on
        one GPU and across two: bench/results/moe_fused_vs_unfused_h200_2026-11-30.md,
        bench/results/ep2_h200_2026-11-30.md), else unfused. ``"split"``: K1 (dispatch + L1)
        and K2 (L2 + scatter) concurrently in disjoint green-context SM partitions and K3
        (top-k reduce) after both, as one CUDA graph per call (bitwise equal to fused).
    ring_blocks: fused: slots (of 64 rows) of the ring pools; default the schedule's
        ``8 x (lag + group) + 4``; at least the full worst-case pool means the ring never wraps.
        split: default the full pool; a ring (at least 32 blocks) bounds how far K1 runs ahead.
        unfused: default the full pool; a ring (blocks of 128 rows, at least 1/64 of the
        worst-case pool) makes a call run in cycles, one window of the pool at a time.
    chunk_ratio: any mode, instead of ``ring_blocks``: the ring as a share in (0, 1] of
        the worst-case pool (at least the mode's minimum), or ``"auto"``: the whole pool when
        the buffer then takes at most half the device memory free now, else the largest ring
        that does.
    split_sms: split: ``(l1, l2, reduce)`` SMs of K1, K2 and K3, or a
        :class:`~megamoe_rt.schedule.split_sms.SplitSms`. K1's count is a multiple of the
        device's partition granularity (8 on Hopper); K2's a multiple of it or every SM K1
        leaves; K3's a multiple of it or the whole device. Default: the split ``megamoe-rt
        tune-split`` stored for this device and shape, else about two thirds to K1, the rest to
        K2 and the whole device to K3 (88 / 44 / 132 on an H200). ``layer.runner.sms`` is the
        split in use.
    timeout_s: deadline of every wait on another block or rank (default
        ``$MEGAMOE_RT_TIMEOUT_S`` or 60 s); a wait past it traps and the error names it.
    group: a :class:`megamoe_rt.ep.launch.RankContext` (``megamoe_rt.ep.launch.context_from_env()``
        in a script started by ``megamoe-rt launch``): run expert-parallel across its ranks,
        ``num_experts`` split evenly (rank r owns experts ``[r*E/R, (r+1)*E/R)``), the buffer on
        the NVSHMEM symmetric heap. Every rank constructs the layer and makes every call.
        The fused mode runs across at most 32 ranks; past that the default is unfused.
    streaming: a :class:`~megamoe_rt.schedule.streaming.StreamConfig`: the buffer gets a
        chunk-ready input ring producers write a call's tokens into chunk by chunk, and
        :meth:`consume` runs the layer on them as they are published (unfused mode;
        ``megamoe_rt.streaming`` has the producer side).
    transport: across ranks, how rows and partials reach other ranks: ``"nvlink"``, loads and
        stores through the peers' mappings of the buffer (one node); ``"nvshmem"``, NVSHMEM's
        device API (any transport NVSHMEM has, NVLink where a peer is mapped; unfused mode
        only); ``"auto"`` (default): ``"nvlink"`` where every rank maps every other, else
        ``"nvshmem"``, decided with the other ranks. ``transport`` holds the choice.
    token_window: any mode: size the whole buffer (pools, per-row metadata, the combine buffer,
        input staging) for this many tokens per rank instead of ``num_max_tokens_per_rank``, and
        run a longer call as consecutive calls over windows of this many tokens, bit for bit
        the same output (megamoe_rt/schedule/token_windows.py, docs/PREFILL.md). Across ranks
        every rank runs the windows of the call's ``num_tokens_bound``. Not with ``streaming``.

    ``mode`` is the mode's name; ``runner`` the mode object (megamoe_rt/modes/) that launches
    the calls, which the test and profiling hooks of :mod:`megamoe_rt.testing` act on.

    Errors found on the device
    --------------------------
    The kernels report refused inputs into mapped host memory instead of stopping, and a call
    never waits for the device to learn about them. A report is raised, as
    :class:`~megamoe_rt.runtime.error_report.DeviceInputError` (a ``ValueError``), by the first
    of these after the failing call has finished on the device:

    - the next call of the layer (which then launches nothing);
    - :meth:`check`, which looks without waiting;
    - :meth:`synchronize`, which first waits for the device.

    Looking costs no wait. Once a report is there, the call or ``check`` that raises it first
    waits for the work on the layer's device to finish (so that no call still running can
    report after the report is taken): only the error path waits.

    Nothing is raised while the stream is being captured into a graph; reports of graph replays
    are raised the same way once the replay has finished. Every report is raised once. The
    output of a call whose inputs were refused is what the layer computes with the refused
    slots left empty.

    Across ranks
    ------------
    A call is a collective, and so are :meth:`check` and :meth:`synchronize`. Before launching,
    the ranks exchange what each found (an argument error, ``num_tokens_bound``, a pending
    device report) through the group's ``allgather``, and either all launch or all raise the
    same error, naming the rank at fault: no rank is left waiting in a kernel for a peer that
    raised. A device report of any rank is raised on every rank, with every rank's findings.

    Construction is collective too. Every setting is the same on every rank (every
    :class:`~megamoe_rt.modes.base.LayerSpec` field and ``mode``, ``ring_blocks``,
    ``chunk_ratio``, ``validate_ids``, ``transport``, ``token_window``), except those in
    :data:`RANK_LOCAL_PARAMETERS` (``device``, ``group``, ``track_expert_stats``,
    ``split_sms``): the ranks compare them before any collective, and settings that differ are
    one ValueError on every rank naming each setting and every rank's value. An argument refused
    on one rank, or a step of set-up failing there (its GPU, its layout, the symmetric heap), is
    raised on every rank as that rank's error, naming it; no rank is left inside NVSHMEM.
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
        # A group that cannot be one (world size 0, a rank outside it) cannot agree on anything:
        # refused here, on the rank that has it, before any exchange.
        rank, world = (0, 1) if group is None else check_group(group)
        if device is not None:
            # A contradiction between the rank's own arguments, refused on it before any exchange.
            device = args.integer("device", device, minimum=0)
            if group is not None and device != group.device:
                raise ValueError(
                    f"device={device}: the rank group runs this rank on device {group.device}; "
                    "pass device=None or the group's device"
                )
        # Across ranks nothing up to the agreement below is collective: a rank whose arguments
        # are refused tells the others there, and every rank raises the same error.
        failure: Exception | None = None
        settings: dict[str, object] = {}
        try:
            given = check_layer_arguments(
                hidden,
                intermediate,
                num_experts,
                num_topk,
                num_max_tokens_per_rank,
                rank=rank,
                world=world,
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
            settings = given.agreed()  # "auto" is compared as given: it decides the collectives below
        except Exception as exc:
            if world == 1:
                raise
            failure = exc
        if world > 1:
            agreement.agree_on_construction(group, settings, failure)  # type: ignore[arg-type]
        spec, transport = given.spec, given.transport
        mode, ring_blocks, chunk_ratio = given.mode, given.ring_blocks, given.chunk_ratio
        self.hidden, self.intermediate = spec.hidden, spec.intermediate
        self.num_experts, self.num_topk = spec.num_experts, spec.num_topk
        self.num_max_tokens_per_rank = given.capacity
        # Tokens per window when calls run in windows (the buffer's token capacity), else None.
        self.token_window = spec.num_max_tokens_per_rank if given.windowed else None

        # Every rank's GPU, before any rank starts NVSHMEM (whose start-up waits for all).
        failure = None
        try:
            if device is None and group is not None:
                device = group.device
            self.device_info = driver.require_hopper(device)
            self.device = self.device_info.ordinal
            driver.ensure_context(self.device)
        except Exception as exc:
            if world == 1:
                raise
            failure = exc
        if world > 1:
            _agree_on_set_up(group, "the ranks' GPUs", failure)  # type: ignore[arg-type]
        if world > 1 and transport == "auto":
            # Resolved before a mode is picked (where a peer is not mapped, only 'unfused' runs):
            # NVSHMEM starts here, its heap sized for the largest buffer the layer may take.
            from megamoe_rt.ep.symm import NvshmemRuntime
            from megamoe_rt.modes.unfused import UnfusedMode

            largest = buffer_layout(replace(spec, transport="nvshmem"), UnfusedMode.layout_needs(spec))
            runtime = NvshmemRuntime.initialize(group, heap_bytes=largest.total_bytes)  # type: ignore[arg-type]
            spec = replace(spec, transport="nvlink" if runtime.every_peer_mapped() else "nvshmem")
        self.transport = spec.transport
        self.timeout_s = spec.timeout_s
        self.swiglu_limit = spec.swiglu_limit
        self.act_sf_gran = spec.act_sf_gran
        self.pow2_scale = spec.pow2_scale
        self.validate_ids = given.validate_ids
        self.debug = spec.debug
        self.streaming = spec.streaming
        self.group = group if world > 1 else None
        self.num_ranks = world
        self.rank = rank
        self.num_local_experts = spec.num_local_experts
        self.first_local_expert = spec.first_local_expert

        # The mode and the buffer's layout (host-only; fused: a ring below the live window is
        # refused here), agreed before any memory is allocated.
        failure = None
        try:
            mode_cls = select_mode(mode, spec, ring_blocks=ring_blocks, split_sms=split_sms, chunk_ratio=chunk_ratio)
            self.mode = mode_cls.name
            # What every call compares (a digest: it is posted with every call): the ranks call
            # layers constructed alike, the mode and transport as resolved.
            self._settings = agreement.settings_digest(agreement.settings_text(given.agreed(spec, mode=mode_cls.name)))
            spec = replace(spec, device=self.device, sm_count=self.device_info.sm_count)
            device = self.device
            self.layout = layer_layout(
                mode_cls,
                spec,
                ring_blocks=ring_blocks,
                chunk_ratio=chunk_ratio,
                free_bytes=lambda: driver.free_memory_bytes(device),
            )
            self.pool_align = self.layout.block_m
            self.token_capacity = self.layout.num_max_tokens_per_rank
            self.runner = mode_cls(spec, self.layout)
        except Exception as exc:
            if self.group is None:
                raise
            failure = exc
        if self.group is not None:
            _agree_on_set_up(self.group, "the mode and the buffer's layout", failure)
        self._weights: Weights | None = None
        self._closed = False
        self.buffer: LayerBuffer
        if self.group is None:
            self.buffer = DeviceBuffer(self.layout, device=self.device)
        else:
            from megamoe_rt.ep.symm import NvshmemRuntime, SymmetricBuffer

            # Each collective (start-up, allocation) agrees first that every rank can enter it.
            runtime = NvshmemRuntime.initialize(self.group, heap_bytes=self.layout.total_bytes)
            # Zeroed on every rank when it returns; peers unmapped only under the NVSHMEM transport.
            symmetric = SymmetricBuffer(self.layout, runtime, require_peer_mapping=spec.transport == "nvlink")
            self.buffer = symmetric
        failure = None
        try:
            # The fused kernel's counters, grid barrier and launch epoch start from zero once;
            # after that every launch leaves them ready for the next. The fills run on CuPy's
            # stream, the calls on the caller's: finish them before any call can be issued.
            cupy = require_cupy()
            with cupy.cuda.Device(self.device):
                if self.group is None:
                    self.buffer.view("workspace").fill(0)
                self.expert_recv_stats = (
                    cupy.zeros(self.num_local_experts, dtype=cupy.int32) if track_expert_stats else None
                )
                cupy.cuda.Device(self.device).synchronize()
            stats = self.expert_recv_stats
            self._errors = ErrorReport(self.device)
            self.runner.bind(
                self.buffer,
                expert_recv_stats=0 if stats is None else int(stats.data.ptr),
                error_report=self._errors.device_ptr,
            )
        except Exception as exc:
            if self.group is None:
                raise
            failure = exc
        if self.group is not None:
            failed = agreement.gather_failures(self.group, "MegaMoE set-up: after the allocation", failure)
            if failed:
                error = agreement.refusal("MegaMoE set-up after the symmetric allocation", failed)
                try:
                    symmetric.close()  # collective: every rank is here, none keeps its part
                except Exception as exc:
                    raise error from exc
                raise error from failure

    # --- weights -------------------------------------------------------------------------

    def load_weights(self, w1: Any, w1_sf: Any, w2: Any, w2_sf: Any, *, stream: Any = None) -> None:
        """Take the weights of this rank's experts in their plain layout (docs/NUMERICS.md; NumPy or CuPy; e4m3 as
        ml_dtypes or uint8 bytes): ``w1`` ``[E, 2I, H]`` (gate rows then up rows), ``w1_sf``
        ``[E, 2I/128, H/128]``, ``w2`` ``[E, H, I]``, ``w2_sf`` ``[E, H/128, I/128]``.

        The layer keeps its own copies, re-laid for the kernels; every step runs on ``stream``
        (default: CuPy's current stream), so calls later on that stream see the new weights;
        a call on another stream must be ordered after it (an event, or a synchronize), or it
        may read weights still being copied.
        The first load builds the mode's plans (across ranks it also compiles and loads the
        kernels now, not at the first call, where a rank still compiling would eat into its
        peers' deadlines). A later load copies into the same device arrays: plans, and graphs
        captured from calls, keep their addresses and read the new weights from their next
        call or replay on; a call or replay still running on another stream must be finished
        first (or ordered before ``stream``), since the copy overwrites what it reads."""
        if self._closed:
            raise RuntimeError("MegaMoE: the layer was closed")
        cupy = require_cupy()
        e, h, i = self.num_local_experts, self.hidden, self.intermediate
        expect = {
            "w1": (e, 2 * i, h),
            "w1_sf": (e, 2 * i // 128, h // 128),
            "w2": (e, h, i),
            "w2_sf": (e, h // 128, i // 128),
        }
        sh = driver.stream_handle(stream)
        arrays = {}
        with cupy.cuda.Device(self.device), cupy_stream(cupy, sh):
            for name, arr in (("w1", w1), ("w1_sf", w1_sf), ("w2", w2), ("w2_sf", w2_sf)):
                is_sf = name.endswith("_sf")
                arrays[name] = self._weight_to_device(cupy, name, arr, expect[name], is_sf, self.device, sh)
            w1p, w1p_sf = prepare_swiglu_weights(arrays["w1"], arrays["w1_sf"])
            fresh = Weights(w1p, w1p_sf, arrays["w2"], arrays["w2_sf"])
            if self._weights is not None:
                for dst, src in zip(self._weights, fresh):
                    dst[...] = src  # same addresses: plans and captured graphs stay valid
                return
        self.runner.load(fresh)
        self._weights = fresh

    @staticmethod
    def _weight_to_device(cupy, name: str, arr: Any, shape: tuple, is_sf: bool, device: int, stream: int):
        """A device copy the layer owns (never the caller's array, which the caller may reuse)."""
        if not hasattr(arr, "shape"):
            raise TypeError(f"{name}: expected a NumPy array or a CUDA array, got {type(arr).__name__}")
        if tuple(arr.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(arr.shape)}")
        if isinstance(arr, np.ndarray):
            if is_sf:
                if arr.dtype != np.float32:
                    raise TypeError(f"{name}: expected float32, got {arr.dtype}")
                return cupy.asarray(arr)
            if arr.dtype != np.uint8 and str(arr.dtype) != "float8_e4m3fn":
                raise TypeError(f"{name}: expected e4m3 (ml_dtypes.float8_e4m3fn or uint8 codes), got {arr.dtype}")
            return cupy.asarray(np.ascontiguousarray(arr).view(np.uint8))
        d = as_device_array(arr, name, stream=stream)
        check_array(d, name, dtypes=("float32",) if is_sf else ("e4m3",), shape=shape, align=16, device=device)
        if d.dtype == "e4m3":  # a native float8 DLPack tensor: view its bytes
            view = cupy.ndarray(
                shape,
                dtype=cupy.uint8,
                memptr=cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(d.ptr, d.nbytes, d.owner), 0),
            )
            return view.copy()
        return cupy.array(cupy.asarray(arr), copy=True, order="C")

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
        ``[T, K]`` (global expert ids, -1 = empty), ``topk_weights`` float32 ``[T, K]``.
        ``out`` (default: a new array) must not share memory with an input (ValueError).
        Inputs must be ready on ``stream``. A layer owns one buffer: calls must be ordered
        (one stream, or streams the caller orders with events).

        ``num_tokens_bound``: at least ``T`` and at most the capacity (default: the capacity).
        The fused mode picks its order from it: a bound whose worst-case pool fits the ring
        runs single-wave, and a smaller bound gives a shorter lag. Across ranks it must be the
        same on every rank (checked on every call). The unfused mode with a ring enqueues the
        cycles the worst-case pool at the bound needs (fewer for a smaller bound); without a
        ring it only checks it.
        """

        def prepare(sh: int) -> tuple[Call, Any]:
            return self._prepare(x, x_sf, topk_idx, topk_weights, out, sh, num_tokens_bound)

        return self._run_call(prepare, stream, self._run_windows)

    def _run_windows(self, call: Call, sh: int) -> None:
        """``call`` as the runner's calls (one per token window with ``token_window=``). One
        rank skips those without tokens; across ranks every rank runs every window of the agreed
        bound (a rank without tokens still serves its experts)."""
        for window in self._windows(call):
            if window.num_tokens or self.group is not None:
                self.runner.run(window, sh)

    def _windows(self, call: Call) -> list[Call]:
        """The calls ``call`` runs as: itself, or one per token window (``token_window=``)."""
        if self.token_window is None:
            return [call]
        h, k = self.hidden, self.num_topk
        return [
            call.window(w.first, w.num_tokens, w.bound, hidden=h, num_topk=k)
            for w in token_windows(call.num_tokens, call.bound, self.token_window)
        ]

    def _run_call(self, prepare, stream, run):
        """The one path of a call (``__call__`` and ``consume``): ``prepare(stream)`` checks it
        and gives the call and its output, ``run(call, stream)`` enqueues it; reports of earlier
        calls are raised first, and after it in debug mode. Across ranks: :meth:`_collective`."""
        if self.group is not None:
            return self._collective(prepare, stream, run)
        self._check_usable()
        sh = driver.stream_handle(stream)
        capturing = driver.stream_is_capturing(sh)
        if not capturing:
            self._raise_reported(wait=False)
        call, y = prepare(sh)
        run(call, sh)
        if self.debug and not capturing:  # a wait would break the capture
            driver.synchronize_stream(sh)
            self._raise_reported(wait=False)
        return y

    def _collective(self, prepare, stream, run):
        """A call is collective: every rank launches, or every rank raises the same error
        (megamoe_rt/ep/agreement.py), including for reports of earlier calls' inputs."""
        assert self.group is not None, "only across ranks"
        capturing, local = False, None
        try:
            self._check_usable()
            sh = driver.stream_handle(stream)
            capturing = driver.stream_is_capturing(sh)
            call, y = prepare(sh)
            status = agreement.CallStatus(bound=call.bound)
        except Exception as exc:  # every rank must learn of it before any launches
            local, status = exc, agreement.CallStatus.of_error(exc)
        status = replace(
            status, reports_pending=self._reports_pending(capturing), capturing=capturing, settings=self._settings
        )
        statuses = agreement.exchange(self.group, status)
        agreement.raise_if_refused(statuses, local)
        # Reports are raised when some rank has one and no rank is capturing (a wait would
        # break the capture; the report stays for a later call).
        if any(s.reports_pending for s in statuses) and not any(s.capturing for s in statuses):
            self._raise_reported_across_ranks()
        run(call, sh)
        if self.debug and not any(s.capturing for s in statuses):
            self._raise_reported_across_ranks()
        return y

    # --- streamed calls ------------------------------------------------------------------

    @property
    def input_ring(self) -> Any:
        """The chunk-ready input ring (``streaming=``): ``descriptor`` is the ``StreamRing`` a
        producer kernel takes (``megamoe_rt.streaming``); None without streaming."""
        return self.runner.input_ring

    def consume(self, num_tokens: int, *, out: Any = None, stream: Any = None, num_tokens_bound: int | None = None):
        """Run the layer on a call's ``num_tokens`` tokens taken from the input ring
        (``streaming=StreamConfig(num_slots, tokens_per_slot)``) as producers publish them, chunk
        by chunk: chunk c is tokens ``[c * tokens_per_slot, ...)``, read from slot
        ``c % num_slots`` once both its halves carry this call's generation, and released
        after the layer's last read. Returns ``y`` (bf16 bits, ``[num_tokens, H]``); no host
        synchronisation. ``num_tokens_bound`` (across ranks the same on every rank, default
        the capacity) sets how many chunks every rank runs.

        Producers must be able to run while the layer waits for them: another stream than
        ``stream``, or enqueued before this call on it (megamoe_rt.streaming, "Progress"). A
        chunk that is never published traps after the deadline, naming the slot and the
        generation waited for."""
        if self.streaming is None:
            raise RuntimeError("MegaMoE.consume: the layer was built without streaming=StreamConfig(...)")

        def prepare(sh: int) -> tuple[Call, Any]:
            return self._prepare_streamed(num_tokens, out, sh, num_tokens_bound)

        return self._run_call(prepare, stream, self.runner.run_streamed)

    def _prepare_streamed(self, num_tokens, out, sh: int, num_tokens_bound) -> tuple[Call, Any]:
        num_tokens = args.integer("num_tokens", num_tokens)
        if not 0 <= num_tokens <= self.num_max_tokens_per_rank:
            raise ValueError(
                f"num_tokens={num_tokens}: expected 0..num_max_tokens_per_rank={self.num_max_tokens_per_rank}"
            )
        bound = self._check_bound(num_tokens_bound, num_tokens)
        h = self.hidden
        cupy = require_cupy()
        with cupy.cuda.Device(self.device), cupy_stream(cupy, sh):
            y = cupy.empty((num_tokens, h), dtype=cupy.uint16) if out is None else out
        ya = as_device_array(y, "out", stream=sh)
        check_array(ya, "out", dtypes=("bf16",), shape=(num_tokens, h), device=self.device)
        return Call(0, 0, 0, 0, ya.ptr, num_tokens, "int32", bound), y

    def _reports_pending(self, capturing: bool) -> bool:
        """Whether the device has reported something this layer raises (no wait)."""
        if capturing or self._closed:
            return False
        return self._errors.pending(ignore=() if self.validate_ids else _ID_ERRORS)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("MegaMoE: the layer was closed")
        if self._weights is None:
            raise RuntimeError("MegaMoE: call load_weights(w1, w1_sf, w2, w2_sf) before running the layer")

    def _prepare(self, x, x_sf, topk_idx, topk_weights, out, sh: int, num_tokens_bound) -> tuple[Call, Any]:
        """The checked call and its output array; raises naming the argument at fault."""
        h, k = self.hidden, self.num_topk
        xa = as_device_array(x, "x", stream=sh)
        check_array(xa, "x", dtypes=("e4m3",), ndim=2, device=self.device)
        t = xa.shape[0]
        if xa.shape[1] != h:
            raise ValueError(f"x: expected shape [T, {h}], got {list(xa.shape)}")
        if t > self.num_max_tokens_per_rank:
            raise ValueError(
                f"x: {t} tokens exceed the layer's capacity (num_max_tokens_per_rank={self.num_max_tokens_per_rank})"
            )
        bound = self._check_bound(num_tokens_bound, t)
        sfa = as_device_array(x_sf, "x_sf", stream=sh)
        check_array(sfa, "x_sf", dtypes=("float32",), shape=(t, h // 128), device=self.device, align=4)
        ia = as_device_array(topk_idx, "topk_idx", stream=sh)
        idx = check_array(
            ia, "topk_idx", dtypes=("int32", "int64"), shape=(t, k), device=self.device, align=ia.itemsize
        )
        wa = as_device_array(topk_weights, "topk_weights", stream=sh)
        check_array(wa, "topk_weights", dtypes=("float32",), shape=(t, k), device=self.device, align=4)
        cupy = require_cupy()
        with cupy.cuda.Device(self.device), cupy_stream(cupy, sh):
            y = cupy.empty((t, h), dtype=cupy.uint16) if out is None else out
        ya = as_device_array(y, "out", stream=sh)
        check_array(ya, "out", dtypes=("bf16",), shape=(t, h), device=self.device)
        check_disjoint(ya, "out", {"x": xa, "x_sf": sfa, "topk_idx": ia, "topk_weights": wa})
        self.runner.load_for_ids(idx)  # before the ranks' exchange: no compile inside a deadline
        return Call(xa.ptr, sfa.ptr, ia.ptr, wa.ptr, ya.ptr, t, idx, bound), y

    # --- errors found on the device ------------------------------------------------------

    def check(self) -> None:
        """Raise what the device has reported about earlier calls' inputs so far
        (:class:`DeviceInputError`; nothing when all is well). It waits for nothing unless a
        report is there; then it waits for the device's work before taking it.
        Across ranks a collective: every rank calls it, and all raise alike."""
        if self.group is None:
            self._raise_reported(wait=False)
            return
        if self._agree_on_reports(key="check"):
            self._raise_reported_across_ranks()

    def synchronize(self) -> None:
        """Wait until all work on the layer's device has finished (calls and graph replays),
        then raise what the device reported, like :meth:`check` (across ranks a collective)."""
        if self.group is None:
            self._raise_reported(wait=True)
            return
        self._agree_on_reports(key="synchronize")
        self._raise_reported_across_ranks()

    def _agree_on_reports(self, *, key: str) -> bool:
        """Across ranks: whether any rank has a report pending; a closed layer on any rank is
        raised on every rank (the exchange comes first, so no rank is left waiting)."""
        assert self.group is not None, "only across ranks"
        local = None if not self._closed else RuntimeError("MegaMoE: the layer was closed")
        status = (
            agreement.CallStatus.of_error(local, settings=self._settings)
            if local
            else agreement.CallStatus(reports_pending=self._reports_pending(False), settings=self._settings)
        )
        statuses = agreement.exchange(self.group, status, key=key)
        agreement.raise_if_refused(statuses, local)
        return any(s.reports_pending for s in statuses)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MegaMoE: the layer was closed")

    def _raise_reported_across_ranks(self) -> None:
        """Every rank waits for its device and takes its report; all raise the union (a collective)."""
        assert self.group is not None, "only across ranks"
        findings: tuple[Finding, ...] = ()
        failure = None
        try:
            driver.synchronize_device(self.device)
            findings = self._errors.take()
        except Exception as exc:  # a sticky device error: every rank must hear of it
            failure = exc
        per_rank = agreement.exchange_findings(self.group, findings, failure)
        if not self.validate_ids:  # the same on every rank (checked with every call's settings)
            per_rank = [tuple(f for f in fs if f.kind not in _ID_ERRORS) for fs in per_rank]
        if any(per_rank):
            text = "\n".join(
                describe_findings(fs, self.num_topk, self.num_experts, r) for r, fs in enumerate(per_rank) if fs
            )
            raise DeviceInputError(text, tuple(f for fs in per_rank for f in fs))

    def _raise_reported(self, *, wait: bool) -> None:
        self._check_open()
        if not wait and not self._reports_pending(False):
            return
        # Let every call in flight finish before the report is cleared, so that a call still
        # reporting cannot write after the clear. Only errors (and synchronize) wait here.
        driver.synchronize_device(self.device)
        findings = self._errors.take()
        if not self.validate_ids:
            findings = tuple(f for f in findings if f.kind not in _ID_ERRORS)
        if findings:
            raise DeviceInputError(
                describe_findings(findings, self.num_topk, self.num_experts, self.rank if self.group else None),
                findings,
            )

    def _check_bound(self, num_tokens_bound: Any, t: int) -> int:
        if num_tokens_bound is None:
            return self.num_max_tokens_per_rank
        bound = args.integer("num_tokens_bound", num_tokens_bound)
        if not t <= bound <= self.num_max_tokens_per_rank:
            raise ValueError(
                f"num_tokens_bound={bound}: expected at least this call's {t} tokens and at most "
                f"the capacity num_max_tokens_per_rank={self.num_max_tokens_per_rank}"
            )
        return max(bound, 1)

    # --- reports -------------------------------------------------------------------------

    def memory_report(self) -> str:
        """Per-region MiB of this layer's buffer, then the mode's notes (fused: the ring against
        the full pool, and the schedule at capacity)."""
        text = self.layout.format_report()
        notes = self.runner.memory_notes()
        if self.token_window is not None:
            notes = "\n".join(filter(None, [notes, self._window_note()]))
        return f"{text}\n{notes}" if notes else text

    def _window_note(self) -> str:
        """The memory report's line on token windows: the buffer against the one a layer
        without a window would allocate (the mode's default pool at the full capacity)."""
        cap, w = self.num_max_tokens_per_rank, self.token_window
        assert w is not None
        line = (
            f"token window: {w} tokens per rank (a call of up to {cap} tokens runs as up to "
            f"{num_windows(cap, w)} windows); buffer {self.layout.total_bytes / 2**20:.2f} MiB"
        )
        try:
            whole = layer_layout(type(self.runner), replace(self.runner.spec, num_max_tokens_per_rank=cap))
        except ValueError as exc:  # a capacity the mode cannot hold in one window at all
            return f"{line}; without a window: not possible ({exc})"
        return f"{line} vs {whole.total_bytes / 2**20:.2f} MiB without a window"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (the buffer is released)."""
        return self._closed

    def close(self) -> None:
        """Release the buffer; the layer cannot be called afterwards. Across ranks this frees
        symmetric memory (after this rank's work is done): every rank calls it."""
        if self._closed:
            return
        self._closed = True
        self._weights = None
        self.runner.close()
        close = getattr(self.buffer, "close", None)
        if close is not None:
            close()
        errors = getattr(self, "_errors", None)
        if errors is not None:
            errors.close()

    def flops(self, num_pairs: int) -> float:
        """Useful FLOPs of a call with ``num_pairs`` routed (token, slot) pairs."""
        return 2.0 * num_pairs * self.hidden * 2 * self.intermediate + 2.0 * num_pairs * self.intermediate * self.hidden
