"""Public grouped FP8 GEMM API for CuPy users.

``D[g] = A[g] . B[g]^T`` with e4m3 operands, fp32 per-row A scales (one per 128
or 64 K elements), fp32 128x128 B block scales, fp32 accumulation promoted per
scale group, bf16 output. Group offsets and counts stay on the GPU: nothing
here synchronises with the host.

Two group layouts:

- contiguous: ``a`` ``[M, K]``; group ``g`` owns rows
  ``[group_offsets[g], group_offsets[g+1])``, each start a multiple of
  :data:`GROUP_ALIGN`; ``group_counts[g]`` (optional) says how many of them are
  real (the rest are padding and are not written).
- masked: ``a`` ``[G, M_max, K]``; the first ``masked_counts[g]`` rows of group
  ``g`` are real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megamoe_rt.kernels import gemm as k
from megamoe_rt.kernels.gemm_heuristics import choose_config
from megamoe_rt.kernels.operands import Fp8Operand, ScaleFactors, activation_operand, kmajor_rows, weight_operand
from megamoe_rt.runtime import args, devices, driver, streams
from megamoe_rt.runtime.arrays import (
    DeviceArray,
    as_device_array,
    check_array,
    check_disjoint,
    cupy_stream,
    require_cupy,
)
from megamoe_rt.runtime.error_report import ErrorReport
from megamoe_rt.runtime.errors import DeviceInputError
from megamoe_rt.runtime.launches import Launches

GROUP_ALIGN = 128  # contiguous-layout group starts; valid for every tile shape


def _array_module(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.ndarray):
        return np
    return require_cupy()


def _kmajor_scales(cupy: Any, rows: int, sf_cols: int) -> DeviceArray:
    """Room for [rows, sf_cols] row scales as [sf_cols, rows padded to 4] (TMA wants
    16-byte row strides); filled by the plan's refresh at run time."""
    t = cupy.zeros((sf_cols, kmajor_rows(rows)), dtype=cupy.float32)
    return as_device_array(t, "a_sf (k-major copy)")


def _check_config(
    cfg: k.GemmConfig, *, layout: str, epilogue: str, a_sf_gran: int, n: int, out_sf_gran: int | None = None
) -> None:
    if not isinstance(cfg, k.GemmConfig):
        raise TypeError(f"config: expected a GemmConfig, got {type(cfg).__name__}")
    if (cfg.layout, cfg.epilogue, cfg.a_sf_gran) != (layout, epilogue, a_sf_gran):
        raise ValueError(
            f"config: {cfg.name} does not match layout={layout}, epilogue={epilogue}, a_sf_gran={a_sf_gran}"
        )
    if out_sf_gran is not None and cfg.out_sf_gran != out_sf_gran:
        raise ValueError(f"config: {cfg.name} requantizes in groups of {cfg.out_sf_gran}, the call asks {out_sf_gran}")
    if n % (cfg.block_n * cfg.cluster_n):
        raise ValueError(f"config: {cfg.name} needs N to be a multiple of {cfg.block_n * cfg.cluster_n}, got {n}")


def _group_layout(group_offsets: Any, group_counts: Any, masked_counts: Any) -> str:
    if (group_offsets is None) == (masked_counts is None):
        raise ValueError("pass exactly one of group_offsets (contiguous layout) and masked_counts (masked layout)")
    if group_counts is not None and masked_counts is not None:
        raise ValueError("group_counts applies to the contiguous layout only")
    return "contiguous" if group_offsets is not None else "masked"


def _set_groups(
    p: k.GemmParams,
    layout: str,
    group_offsets: Any,
    group_counts: Any,
    masked_counts: Any,
    groups: int,
    dev: int | None,
) -> tuple[Any, ...]:
    """Set the group arrays' addresses; returns what keeps them alive (the plan holds it)."""
    used = []
    if layout == "contiguous":
        used.append(_check_groups("group_offsets", group_offsets, groups + 1, dev))
        p.group_offsets = used[-1].ptr
        if group_counts is not None:
            used.append(_check_groups("group_counts", group_counts, groups, dev))
            p.group_counts = used[-1].ptr
    else:
        used.append(_check_groups("masked_counts", masked_counts, groups, dev))
        p.masked_counts = used[-1].ptr
    return tuple(_owner(d) for d in used)


def _per_row_array(arr: Any, name: str, dtype: str, rows: int, device: int | None, sh: int) -> DeviceArray:
    """A per-row array of the group layout: ``[rows]``, or longer when A is a window of a larger
    row space (a ring's pool: :meth:`GroupedGemmPlan.enqueue_window` reads the rows past ``rows``)."""
    d = as_device_array(arr, name, stream=sh)
    check_array(d, name, dtypes=(dtype,), ndim=1, device=device, align=d.itemsize)
    if d.shape[0] < rows:
        raise ValueError(f"{name}: expected at least {rows} rows (one per row of a), got shape {list(d.shape)}")
    return d


def _owner(d: DeviceArray) -> Any:
    """What keeps the memory behind a borrowed view alive (the producer, else the view)."""
    return d.owner if d.owner is not None else d


def _check_groups(name: str, arr: Any, length: int, device: int | None) -> DeviceArray:
    d = as_device_array(arr, name)
    check_array(d, name, dtypes=("int32",), shape=(length,), device=device, align=4)
    return d


@dataclass
class GroupedGemmPlan:
    """A validated, resolved grouped-GEMM call bound to its arrays; ``run`` re-launches it.

    Plans are what CUDA-graph capture and benchmarks replay: a run is one or two driver
    calls (plus the scale re-layout when ``a_sf`` is not already k-major). Arrays are
    bound by address: refill them in place between runs.
    """

    gemm: k.PreparedGemm
    layout_check: k.PreparedGemm | None
    result: Any
    stream: int
    refresh_scales: Callable[[int], None] | None = None
    keep: tuple[Any, ...] = ()
    errors: ErrorReport | None = None  # what the layout check reports into
    device: int | None = None
    layout: str = "contiguous"
    num_groups: int = 0

    def run(self, stream: Any = None) -> Any:
        """Enqueue the GEMM (and its layout check). A bad group layout an earlier run's check
        reported is raised here first, as :class:`DeviceInputError`, and nothing is launched
        (not while ``stream`` is being captured: then the next run or :meth:`check` raises it).
        A plan runs on one stream at a time: its layout check has one state word."""
        sh = self.stream if stream is None else streams.stream_handle(stream)
        if self.errors is not None and self.errors.pending() and not streams.stream_is_capturing(sh):
            self.check(wait=True)
        if self.refresh_scales is not None:
            self.refresh_scales(sh)
        if self.layout_check is not None:
            self.layout_check.run(sh)
        if self.gemm.args:
            # The whole of A, in place (enqueue_window / run_block_mapped may have changed them).
            self.gemm.args[0].row_base = 0
            self.gemm.args[0].block_map = 0
        self.gemm.run(sh)
        return self.result

    def enqueue_window(self, launches: Launches, row_base: int = 0) -> None:
        """Enqueue the GEMM into ``launches`` (a stream or a graph being recorded): A and D hold
        the rows ``[row_base, row_base + rows of A)`` of the group layout (group offsets, counts
        and per-row metadata stay in layout rows; 0 without a ring). For the unfused layer;
        plans with a layout check or a scale re-layout are run with :meth:`run`."""
        assert self.layout_check is None and self.refresh_scales is None and self.layout == "contiguous"
        assert row_base >= 0 and row_base % GROUP_ALIGN == 0, f"row_base={row_base}: a multiple of {GROUP_ALIGN}"
        if self.gemm.args:
            self.gemm.args[0].row_base = row_base
            self.gemm.args[0].block_map = 0
        self.gemm.enqueue(launches)

    def run_block_mapped(self, stream: int, block_map: int) -> None:
        """Enqueue the GEMM over a pool whose blocks were handed out out of order: ``block_map``
        (device int32, one entry per ``BLOCK_MAP_ROWS`` rows of the group layout) names the
        block of A, D and the per-row metadata that holds each block of the layout. For the
        unfused layer's streamed calls (megamoe_rt/modes/stream_pool.py)."""
        assert self.layout_check is None and self.refresh_scales is None and self.layout == "contiguous"
        if self.gemm.args:
            self.gemm.args[0].row_base = 0
            self.gemm.args[0].block_map = block_map
        self.gemm.run(stream)

    def check(self, *, wait: bool = False) -> None:
        """Raise what the layout check has reported (a ValueError naming the bad group entry).
        ``wait``: first wait for all work on the device, so every run so far has been checked."""
        if self.errors is None or not (wait or self.errors.pending()):
            return
        driver.synchronize_device(self.device)
        found = self.errors.take()
        if found:
            f = found[0]
            g = self.num_groups
            if self.layout == "masked":
                entry = f"masked_counts[{f.where}] = {f.what_signed} (expected 0..rows per group)"
            elif f.where <= g:
                entry = (
                    f"group_offsets[{f.where}] = {f.what_signed} (expected non-decreasing multiples of the "
                    f"tile height, at most the rows of a)"
                )
            else:
                entry = f"group_counts[{f.where - g - 1}] = {f.what_signed} (expected >= 0)"
            raise DeviceInputError(f"grouped GEMM: {entry}; the GEMM was skipped (output not written)", found)


def grouped_gemm_fp8(a: Any, a_sf: Any, b: Any, b_sf: Any, **kwargs: Any) -> Any:
    """Grouped FP8 GEMM; returns ``out`` (bf16 bits as uint16) or None with ``row_dst``.
    Arguments as :func:`plan_grouped_gemm_fp8`; this plans and runs once. With
    ``check_layout=True`` (the default) it waits for the device's layout check and raises
    :class:`DeviceInputError` for a bad group layout; plans do not wait (see
    :meth:`GroupedGemmPlan.run`)."""
    return _run_once(plan_grouped_gemm_fp8(a, a_sf, b, b_sf, **kwargs))


def _run_once(plan: GroupedGemmPlan) -> Any:
    result = plan.run()
    plan.check(wait=True)
    return result


def plan_grouped_gemm_fp8(
    a: Any,
    a_sf: Any,
    b: Any,
    b_sf: Any,
    *,
    group_offsets: Any = None,
    group_counts: Any = None,
    masked_counts: Any = None,
    out: Any = None,
    row_dst: Any = None,
    stream: Any = None,
    check_layout: bool = True,
    a_sf_kmajor: bool = False,
    config: k.GemmConfig | None = None,
    wait: k.WaitContext | None = None,
) -> GroupedGemmPlan:
    """Validate and resolve a grouped FP8 GEMM call into a :class:`GroupedGemmPlan`.

    a: e4m3 (uint8) ``[M, K]`` (contiguous) or ``[G, M_max, K]`` (masked).
    a_sf: float32 ``[M, K/128]`` / ``[G, M_max, K/128]`` (or ``K/64`` columns for 1x64 scales).
    b: e4m3 ``[G, N, K]``; b_sf: float32 ``[G, N/128, K/128]``.
    Exactly one of ``group_offsets`` (int32 ``[G+1]``) and ``masked_counts`` (int32 ``[G]``).
    ``row_dst``: uint64 ``[M]`` (or longer) byte addresses; row r of D is written there (0 skips it)
    instead of into ``out`` (bf16 as uint16 ``[M, N]`` / ``[G, M_max, N]``, 16-byte aligned:
    rows are stored 16 bytes at a time; allocated when not given). ``check_layout`` runs a one-thread device check of the
    offsets/counts before each GEMM: a violated contract makes that GEMM do nothing and is
    raised by the plan's next :meth:`~GroupedGemmPlan.run` or :meth:`~GroupedGemmPlan.check`.
    ``a_sf_kmajor=True``: ``a_sf`` is already ``[K/gran, rows_pad]`` (rows padded to a
    multiple of 4), the layout the SwiGLU epilogue writes, and is used without a copy.
    ``config`` overrides the heuristic's tile choice (tuning and tests); it must match the
    call's layout, epilogue and scale granularity. ``wait``: the deadline of the kernel's
    pipeline waits and where a timed-out one is recorded (default: the process's timeout
    record with ``MEGAMOE_RT_TIMEOUT_S``).
    """
    layout = _group_layout(group_offsets, group_counts, masked_counts)
    sh = streams.stream_handle(stream)
    bo = weight_operand(b, b_sf, stream=sh)
    ao = activation_operand(a, a_sf, weights=bo, masked=layout == "masked", kmajor=a_sf_kmajor, stream=sh)
    groups, n, kk, dev = bo.groups, bo.rows, bo.k, bo.device
    rows, lead = ao.total_rows, ao.shape[:-1]

    info = devices.require_hopper(dev)
    cupy = require_cupy()
    # Temporaries and outputs come from CuPy's pool on the launch stream, so a
    # block is never handed out while earlier work on another stream still uses it.
    with cupy.cuda.Device(info.ordinal), cupy_stream(cupy, sh):
        epilogue = "scatter_bf16" if row_dst is not None else "bf16"
        cfg = config or choose_config(
            layout=layout,
            epilogue=epilogue,
            num_rows=rows,
            n=n,
            k=kk,
            num_groups=groups,
            sm_count=info.sm_count,
            masked_rows=_masked_rows(ao),
            a_sf_gran=_scales(ao).gran_k,
        )
        _check_config(cfg, layout=layout, epilogue=epilogue, a_sf_gran=_scales(ao).gran_k, n=n)
        p = _params(ao, bo, wait)
        refs = _set_groups(p, layout, group_offsets, group_counts, masked_counts, groups, dev)
        epilogue_params: k.ScatterBf16Params | k.StoreBf16Params
        if row_dst is not None:
            if out is not None:
                raise ValueError("pass either out or row_dst, not both")
            rd = _per_row_array(row_dst, "row_dst", "uint64", rows, dev, sh)
            epilogue_params = k.ScatterBf16Params(row_dst=rd.ptr)
            refs += (_owner(rd),)
            result = None
        else:
            out_shape = lead + (n,)
            result = cupy.empty(out_shape, dtype=cupy.uint16) if out is None else out
            oa = as_device_array(result, "out", stream=sh)
            check_array(oa, "out", dtypes=("bf16",), shape=out_shape, device=dev, align=16)  # 16-byte row stores
            check_disjoint(oa, "out", _operand_arrays(ao, bo))
            epilogue_params = k.StoreBf16Params(d=oa.ptr, d_row_stride_bytes=n * 2)
            refs += (_owner(oa),)
        return _plan(cupy, info, cfg, p, epilogue_params, ao, bo, a_sf, check_layout, result, sh, refs)


def _operand_arrays(*ops: Fp8Operand) -> dict[str, DeviceArray | None]:
    """The caller's arrays behind GEMM operands and their scales, by argument name."""
    found: dict[str, DeviceArray | None] = {}
    for op in ops:
        found[op.name] = op.array
        if op.scales is not None:
            found[op.scales.name] = op.scales.array
    return found


def _scales(op: Fp8Operand) -> ScaleFactors:
    """The scales of an operand built by weight_operand / activation_operand (which always set them)."""
    assert op.scales is not None, f"{op.name}: operand has no scales"
    return op.scales


def _masked_rows(a: Fp8Operand) -> int:
    return a.rows if a.stacked else 0


def _params(a: Fp8Operand, b: Fp8Operand, wait: k.WaitContext | None) -> k.GemmParams:
    """The shape fields of the launch parameters, from its operands, and the deadline of the
    pipeline's waits (default: this process's timeout record, MEGAMOE_RT_TIMEOUT_S)."""
    if wait is None:
        from megamoe_rt.runtime.deadlines import TimeoutRecord

        wait = TimeoutRecord.get().context()
    return k.GemmParams(
        wait=wait,
        num_rows=a.total_rows,
        n=b.rows,
        k=b.k,
        num_groups=b.groups,
        masked_rows=_masked_rows(a),
        sfb=_scales(b).ptr,
    )


def _plan(
    cupy: Any,
    info: devices.DeviceInfo,
    cfg: k.GemmConfig,
    p: k.GemmParams,
    epilogue_params: Any,
    a: Fp8Operand,
    b: Fp8Operand,
    a_sf_obj: Any,
    check_layout: bool,
    result: Any,
    sh: int,
    refs: tuple[Any, ...],
) -> GroupedGemmPlan:
    """``epilogue_params``: the config's epilogue's struct. ``refs``: owners of every other array
    ``p`` and it point to (groups, outputs, row maps)."""
    rows = a.total_rows
    if rows == 0:
        return GroupedGemmPlan(k.PreparedGemm(None, 0, 0, (1, 1, 1), []), None, result, sh)
    refresh = None
    keep: tuple[Any, ...] = (a.array, _scales(a).array, b.array, _scales(b).array, *refs)
    if not _scales(a).kmajor:
        # TMA loads the scales k-major; the plan re-lays the caller's row-major ones before each run.
        src = cupy.asarray(a_sf_obj)
        sfa_t = _kmajor_scales(cupy, rows, a.k // _scales(a).gran_k)
        dst = cupy.asarray(sfa_t.owner)

        def relayout_scales(stream_handle: int) -> None:
            with cupy_stream(cupy, stream_handle):
                dst[:, :rows] = src.reshape(rows, -1).T

        refresh = relayout_scales
        a = a.with_scales(_scales(a).kmajor_copy(a, sfa_t))

    check, errors = None, None
    if check_layout:
        state = cupy.zeros(1, dtype=cupy.uint32)
        errors = ErrorReport(info.ordinal)
        p.layout_state = int(state.data.ptr)
        keep += (state,)
    launch = k.GemmLaunch(cfg, a, b, p, epilogue_params)
    gemm = k.prepare_gemm(launch, device=info.ordinal, sm_count=info.sm_count)
    if errors is not None:
        check = k.prepare_layout_check(
            launch, device=info.ordinal, state=p.layout_state, error_report=errors.device_ptr
        )
    return GroupedGemmPlan(
        gemm,
        check,
        result,
        sh,
        refresh,
        keep=keep + (_scales(a).array,),
        errors=errors,
        device=info.ordinal,
        layout=cfg.layout,
        num_groups=p.num_groups,
    )


# --- L1 with the fused SwiGLU / requant epilogue ------------------------------------------

SWIGLU_HALF = 64  # gate|up interleave unit of prepared w1 (one B-scale chunk)


def prepare_swiglu_weights(w1: Any, w1_sf: Any) -> tuple[Any, Any]:
    """Re-lay ``w1`` ``[G, 2I, H]`` (gate rows then up rows) and ``w1_sf`` ``[G, 2I/128, H/128]``
    for the fused L1 epilogue: rows interleaved in 64-row halves ``gate[c], up[c], gate[c+1], ...``
    and scales per 64-row half, ``[G, 2I/64, H/128]``. Works on NumPy or CuPy arrays; run once at
    weight load."""
    for name, arr in (("w1", w1), ("w1_sf", w1_sf)):
        if not (hasattr(arr, "shape") and hasattr(arr, "ndim")):
            raise TypeError(f"{name}: expected a NumPy or CuPy array, got {type(arr).__name__}")
    xp = _array_module(w1)
    if w1.ndim != 3 or w1.shape[1] % 256:
        raise ValueError(f"w1: expected [G, 2I, H] with I a multiple of 128, got {list(w1.shape)}")
    g, two_i, h = w1.shape
    i = two_i // 2
    if tuple(w1_sf.shape) != (g, two_i // 128, h // 128):
        raise ValueError(f"w1_sf: expected shape {[g, two_i // 128, h // 128]}, got {list(w1_sf.shape)}")
    halves = i // SWIGLU_HALF
    gate = w1[:, :i].reshape(g, halves, SWIGLU_HALF, h)
    up = w1[:, i:].reshape(g, halves, SWIGLU_HALF, h)
    w1p = xp.ascontiguousarray(xp.stack([gate, up], axis=2).reshape(g, two_i, h))
    # Half c of gate lies in gate scale block (64c)//128; half c of up in block (I + 64c)//128.
    blocks = xp.arange(halves) * SWIGLU_HALF // 128
    sf_gate = w1_sf[:, blocks]
    sf_up = w1_sf[:, i // 128 + blocks]
    w1p_sf = xp.ascontiguousarray(xp.stack([sf_gate, sf_up], axis=2).reshape(g, two_i // SWIGLU_HALF, h // 128))
    return w1p, w1p_sf


def grouped_gemm_swiglu_fp8(a: Any, a_sf: Any, w1p: Any, w1p_sf: Any, row_weight: Any, **kwargs: Any) -> Any:
    """L1 GEMM with the fused epilogue; arguments as :func:`plan_grouped_gemm_swiglu_fp8`.
    Plans, runs once and returns ``(q, sf)`` (waiting for the layout check as
    :func:`grouped_gemm_fp8` does)."""
    return _run_once(plan_grouped_gemm_swiglu_fp8(a, a_sf, w1p, w1p_sf, row_weight, **kwargs))


def plan_grouped_gemm_swiglu_fp8(
    a: Any,
    a_sf: Any,
    w1p: Any,
    w1p_sf: Any,
    row_weight: Any,
    *,
    group_offsets: Any = None,
    group_counts: Any = None,
    masked_counts: Any = None,
    act_sf_gran: int = 128,
    swiglu_limit: float | None = None,
    pow2_scale: bool = False,
    out: Any = None,
    out_sf: Any = None,
    stream: Any = None,
    check_layout: bool = True,
    config: k.GemmConfig | None = None,
    a_sf_kmajor: bool = False,
    wait: k.WaitContext | None = None,
) -> GroupedGemmPlan:
    """L1 GEMM with the SwiGLU x weight -> e4m3 epilogue.

    ``w1p``/``w1p_sf`` come from :func:`prepare_swiglu_weights`. ``row_weight`` float32 ``[rows]``
    (or longer) is each row's top-k weight. Returns ``(q, sf)``: ``q`` uint8 e4m3 ``[rows, I]`` and ``sf``
    float32 ``[I/act_sf_gran, rows_pad]`` (K-block major: the layout the L2 GEMM's TMA reads;
    ``rows_pad`` is rows rounded up to 4). ``out`` / ``out_sf`` given: written in place (``out``
    16-byte aligned: rows are stored 16 bytes at a time).
    """
    act_sf_gran = args.integer_choice("act_sf_gran", act_sf_gran, (64, 128))
    if swiglu_limit is not None:
        swiglu_limit = args.positive_float32("swiglu_limit", swiglu_limit)
    layout = _group_layout(group_offsets, group_counts, masked_counts)
    sh = streams.stream_handle(stream)
    bo = weight_operand(w1p, w1p_sf, name="w1p", sf_name="w1p_sf", sf_rows=SWIGLU_HALF, stream=sh)
    if bo.rows % 256:
        raise ValueError(f"w1p: N = 2I = {bo.rows} (shape {list(bo.shape)}) must be a multiple of 256")
    ao = activation_operand(a, a_sf, weights=bo, masked=layout == "masked", kmajor=a_sf_kmajor, grans=(128,), stream=sh)
    groups, two_i, kk, dev = bo.groups, bo.rows, bo.k, bo.device
    inter = two_i // 2
    rows, lead = ao.total_rows, ao.shape[:-1]
    rw = _per_row_array(row_weight, "row_weight", "float32", rows, dev, sh)

    info = devices.require_hopper(dev)
    cupy = require_cupy()
    rows_pad = kmajor_rows(rows)
    with cupy.cuda.Device(info.ordinal), cupy_stream(cupy, sh):
        q = cupy.empty(lead + (inter,), dtype=cupy.uint8) if out is None else out
        sf = cupy.empty((inter // act_sf_gran, rows_pad), dtype=cupy.float32) if out_sf is None else out_sf
        qa = as_device_array(q, "out")
        check_array(qa, "out", dtypes=("e4m3",), shape=lead + (inter,), device=dev, align=16)  # 16-byte row stores
        sfo = as_device_array(sf, "out_sf")
        check_array(sfo, "out_sf", dtypes=("float32",), shape=(inter // act_sf_gran, rows_pad), device=dev, align=4)
        check_disjoint(qa, "out", {**_operand_arrays(ao, bo), "out_sf": sfo})
        check_disjoint(sfo, "out_sf", _operand_arrays(ao, bo))
        cfg = config or choose_config(
            layout=layout,
            epilogue="swiglu_fp8",
            num_rows=rows,
            n=two_i,
            k=kk,
            num_groups=groups,
            sm_count=info.sm_count,
            masked_rows=_masked_rows(ao),
            out_sf_gran=act_sf_gran,
        )
        _check_config(cfg, layout=layout, epilogue="swiglu_fp8", a_sf_gran=128, n=two_i, out_sf_gran=act_sf_gran)
        flags = (k.FLAG_CLAMP if swiglu_limit is not None else 0) | (k.FLAG_POW2_SCALE if pow2_scale else 0)
        p = _params(ao, bo, wait)
        epilogue_params = k.SwigluFp8Params(
            d=qa.ptr,
            d_row_stride_bytes=inter,
            d_sf=sfo.ptr,
            d_sf_row_stride=rows_pad,
            row_weight=rw.ptr,
            swiglu_limit=float(swiglu_limit or 0.0),
            flags=flags,
        )
        refs = _set_groups(p, layout, group_offsets, group_counts, masked_counts, groups, dev)
        refs += (_owner(rw), _owner(qa), _owner(sfo))
        return _plan(cupy, info, cfg, p, epilogue_params, ao, bo, a_sf, check_layout, (q, sf), sh, refs)
