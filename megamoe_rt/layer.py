"""``MegaMoE``: one expert-parallel FP8 MoE FFN layer (unfused mode, one rank).

A call runs, on one stream with no host synchronisation between the steps:
route counting -> block-aligned pool offsets -> dispatch into the expert pool ->
L1 grouped GEMM with the SwiGLU / top-k weight / FP8 requant epilogue -> L2 grouped
GEMM scattering bf16 rows to their combine slots -> combine (slot-order sum). The
whole call can therefore be captured in a CUDA graph and replayed with new inputs
written into the same arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import driver
from .arrays import as_device_array, check_array, cupy_stream, require_cupy
from .buffer import DeviceBuffer
from .gemm import plan_grouped_gemm_fp8, plan_grouped_gemm_swiglu_fp8, prepare_swiglu_weights
from .kernels import moe as mk
from .kernels.loader import get_kernel
from .layout import symm_buffer_layout

POOL_ALIGN = 128  # expert ranges in the pool start on GEMM-tile boundaries


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


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
    validate_ids: check expert ids before launching (one small reduction and a host
        read; skipped while the stream is being captured into a graph).
    debug: also check ids on the device and raise after the call.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, num_topk: int,
                 num_max_tokens_per_rank: int, *, swiglu_limit: float | None = None, act_sf_gran: int = 128,
                 pow2_scale: bool = False, track_expert_stats: bool = False, validate_ids: bool = True,
                 debug: bool = False, device: int | None = None):
        self.hidden = _positive("hidden", hidden)
        self.intermediate = _positive("intermediate", intermediate)
        self.num_experts = _positive("num_experts", num_experts)
        self.num_topk = _positive("num_topk", num_topk)
        self.num_max_tokens_per_rank = _positive("num_max_tokens_per_rank", num_max_tokens_per_rank)
        if self.hidden % 128 or self.intermediate % 128:
            raise ValueError(f"hidden={hidden}, intermediate={intermediate}: both must be multiples of 128")
        if self.num_topk > min(self.num_experts, mk.MAX_TOPK):
            raise ValueError(f"num_topk={num_topk}: expected at most min(num_experts={num_experts}, {mk.MAX_TOPK})")
        if self.num_experts > mk.MAX_LOCAL_EXPERTS:
            raise ValueError(f"num_experts={num_experts}: at most {mk.MAX_LOCAL_EXPERTS} local experts are supported")
        if act_sf_gran not in (64, 128):
            raise ValueError(f"act_sf_gran: expected 64 or 128, got {act_sf_gran!r}")
        if swiglu_limit is not None and not (float(swiglu_limit) > 0):
            raise ValueError(f"swiglu_limit: expected a positive number or None, got {swiglu_limit!r}")
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.act_sf_gran = act_sf_gran
        self.pow2_scale = bool(pow2_scale)
        self.validate_ids = bool(validate_ids)
        self.debug = bool(debug)
        self.num_ranks = 1
        self.num_local_experts = self.num_experts

        self.device_info = driver.require_hopper(device)
        self.device = self.device_info.ordinal
        driver.ensure_context(self.device)
        self.layout = symm_buffer_layout(self.hidden, self.intermediate, self.num_experts, self.num_topk,
                                         self.num_max_tokens_per_rank, 1, block_m=POOL_ALIGN,
                                         act_sf_gran=act_sf_gran)
        self.token_capacity = self.layout.num_max_tokens_per_rank
        self.buffer = DeviceBuffer(self.layout, device=self.device)
        cupy = require_cupy()
        with cupy.cuda.Device(self.device):
            self.expert_recv_stats = (cupy.zeros(self.num_local_experts, dtype=cupy.int32)
                                      if track_expert_stats else None)
        self._plans = None
        self._kernels: dict[tuple[str, str], dict[str, Any]] = {}

    # --- weights -------------------------------------------------------------------------

    def load_weights(self, w1: Any, w1_sf: Any, w2: Any, w2_sf: Any) -> None:
        """Take the plain layout of DESIGN §3 (NumPy or CuPy; e4m3 as ml_dtypes or uint8 bytes):
        ``w1`` ``[E, 2I, H]`` (gate rows then up rows), ``w1_sf`` ``[E, 2I/128, H/128]``,
        ``w2`` ``[E, H, I]``, ``w2_sf`` ``[E, H/128, I/128]``. Re-laid once here."""
        cupy = require_cupy()
        e, h, i = self.num_local_experts, self.hidden, self.intermediate
        expect = {"w1": (e, 2 * i, h), "w1_sf": (e, 2 * i // 128, h // 128),
                  "w2": (e, h, i), "w2_sf": (e, h // 128, i // 128)}
        arrays = {}
        with cupy.cuda.Device(self.device):
            for name, arr in (("w1", w1), ("w1_sf", w1_sf), ("w2", w2), ("w2_sf", w2_sf)):
                is_sf = name.endswith("_sf")
                arrays[name] = self._weight_to_device(cupy, name, arr, expect[name], is_sf, self.device)
            w1p, w1p_sf = prepare_swiglu_weights(arrays["w1"], arrays["w1_sf"])
        self._w1p, self._w1p_sf = w1p, w1p_sf
        self._w2, self._w2_sf = arrays["w2"], arrays["w2_sf"]
        self._plans = self._build_plans()

    @staticmethod
    def _weight_to_device(cupy, name: str, arr: Any, shape: tuple, is_sf: bool, device: int):
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
        d = as_device_array(arr, name)
        check_array(d, name, dtypes=("float32",) if is_sf else ("e4m3",), shape=shape, align=16, device=device)
        if d.dtype == "e4m3":  # a native float8 DLPack tensor: view its bytes
            return cupy.ndarray(shape, dtype=cupy.uint8,
                                memptr=cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(d.ptr, d.nbytes, d.owner), 0))
        return cupy.ascontiguousarray(cupy.asarray(arr))

    def _build_plans(self):
        b = self.buffer
        # One rank: the received counts are this rank's own row of expert_recv_counts.
        counts = b.view("expert_recv_counts").reshape(-1)
        common = dict(group_offsets=b.view("expert_pool_offsets"), group_counts=counts,
                      check_layout=False, a_sf_kmajor=True, stream=0)
        l1 = plan_grouped_gemm_swiglu_fp8(
            b.view("l1_pool"), b.view("l1_pool_sf"), self._w1p, self._w1p_sf, b.view("l1_pool_weight"),
            act_sf_gran=self.act_sf_gran, swiglu_limit=self.swiglu_limit, pow2_scale=self.pow2_scale,
            out=b.view("l2_pool"), out_sf=b.view("l2_pool_sf"), **common)
        l2 = plan_grouped_gemm_fp8(b.view("l2_pool"), b.view("l2_pool_sf"), self._w2, self._w2_sf,
                                   row_dst=b.view("l1_pool_dst"), **common)
        return l1, l2

    # --- call ----------------------------------------------------------------------------

    def _kernels_for(self, idx: str) -> dict[str, Any]:
        key = (idx, str(self.device))
        if key not in self._kernels:
            self._kernels[key] = {
                "count": get_kernel(mk.count_spec(idx), self.device),
                "offsets": get_kernel(mk.offsets_spec(), self.device),
                "dispatch": get_kernel(mk.dispatch_spec(idx), self.device),
                "combine": get_kernel(mk.combine_spec(idx), self.device),
            }
        return self._kernels[key]

    def __call__(self, x: Any, x_sf: Any, topk_idx: Any, topk_weights: Any, *, out: Any = None,
                 stream: Any = None):
        """Run the layer; returns ``y`` (bf16 bits as uint16, ``[T, H]``).

        ``x`` e4m3 (uint8) ``[T, H]``, ``x_sf`` float32 ``[T, H/128]``, ``topk_idx`` int32/int64
        ``[T, K]`` (global expert ids, -1 = empty), ``topk_weights`` float32 ``[T, K]``.
        Inputs must be ready on ``stream``. A layer owns one buffer: calls must be ordered
        (one stream, or streams the caller orders with events).
        """
        if self._plans is None:
            raise RuntimeError("MegaMoE: call load_weights(w1, w1_sf, w2, w2_sf) before running the layer")
        sh = driver.stream_handle(stream)
        h, k = self.hidden, self.num_topk
        xa = as_device_array(x, "x", stream=sh)
        check_array(xa, "x", dtypes=("e4m3",), ndim=2, device=self.device)
        t = xa.shape[0]
        if xa.shape[1] != h:
            raise ValueError(f"x: expected shape [T, {h}], got {list(xa.shape)}")
        if t > self.num_max_tokens_per_rank:
            raise ValueError(f"x: {t} tokens exceed the layer's capacity "
                             f"(num_max_tokens_per_rank={self.num_max_tokens_per_rank})")
        sfa = as_device_array(x_sf, "x_sf", stream=sh)
        check_array(sfa, "x_sf", dtypes=("float32",), shape=(t, h // 128), device=self.device, align=4)
        ia = as_device_array(topk_idx, "topk_idx", stream=sh)
        idx = check_array(ia, "topk_idx", dtypes=("int32", "int64"), shape=(t, k), device=self.device,
                          align=ia.itemsize)
        wa = as_device_array(topk_weights, "topk_weights", stream=sh)
        check_array(wa, "topk_weights", dtypes=("float32",), shape=(t, k), device=self.device, align=4)
        cupy = require_cupy()
        with cupy.cuda.Device(self.device), cupy_stream(cupy, sh):
            y = cupy.empty((t, h), dtype=cupy.uint16) if out is None else out
            ya = as_device_array(y, "out", stream=sh)
            check_array(ya, "out", dtypes=("bf16",), shape=(t, h), device=self.device)
            if t == 0:
                return y
            capturing = driver.stream_is_capturing(sh)
            if self.validate_ids and not capturing:
                ids = cupy.asarray(topk_idx)
                bad = cupy.count_nonzero((ids < -1) | (ids >= self.num_experts))
                if int(bad):
                    raise ValueError(f"topk_idx: {int(bad)} expert id(s) outside [-1, {self.num_experts})")
            params = self._params(xa, sfa, ia, wa, ya, t)
            kernels = self._kernels_for(idx)
            grid = mk.grids(t, k, self.device_info.sm_count)
            b = self.buffer
            driver.memset_d32_async(b.ptr("expert_recv_counts"), 0, self.num_local_experts, sh)
            driver.memset_d32_async(b.ptr("error_flags"), 0, 4, sh)
            mk.launch_route_dispatch(kernels, params, grid, sh)
            l1, l2 = self._plans
            l1.run(sh)
            l2.run(sh)
            mk.launch_combine(kernels, params, grid, sh)
            if self.debug and not capturing:  # a read-back would break the capture
                flags = int(b.view("error_flags")[0].get(stream=cupy_stream(cupy, sh)))
                if flags & mk.ERROR_EXPERT_ID_OUT_OF_RANGE:
                    raise ValueError(f"topk_idx: expert ids outside [-1, {self.num_experts}) (found on the device)")
                if flags & mk.ERROR_POOL_OVERFLOW:
                    raise ValueError("topk_idx: routing overflowed the expert pool (repeated experts in a token?)")
        return y

    def _params(self, xa, sfa, ia, wa, ya, t: int) -> mk.MoeParams:
        b = self.buffer
        stats = self.expert_recv_stats
        return mk.MoeParams(
            topk_idx=ia.ptr, topk_weights=wa.ptr, x=xa.ptr, x_sf=sfa.ptr,
            num_tokens=t, num_topk=self.num_topk, hidden=self.hidden, num_experts=self.num_experts,
            num_local_experts=self.num_local_experts, first_local_expert=0, pool_rows=self.layout.pool_rows,
            pool_align=POOL_ALIGN, token_capacity=self.token_capacity,
            expert_counts=b.ptr("expert_recv_counts"), expert_offsets=b.ptr("expert_pool_offsets"),
            expert_cursors=b.ptr("expert_cursors"),
            expert_recv_stats=0 if stats is None else int(stats.data.ptr),
            error_flags=b.ptr("error_flags"), pool=b.ptr("l1_pool"), pool_sf=b.ptr("l1_pool_sf"),
            pool_src=b.ptr("l1_pool_src"), pool_weight=b.ptr("l1_pool_weight"), pool_dst=b.ptr("l1_pool_dst"),
            combine=b.ptr("combine"), y=ya.ptr,
        )

    # --- reports -------------------------------------------------------------------------

    def memory_report(self) -> str:
        """Per-region MiB of this layer's buffer."""
        return self.layout.format_report()

    def flops(self, num_pairs: int) -> float:
        """Useful FLOPs of a call with ``num_pairs`` routed (token, slot) pairs."""
        return 2.0 * num_pairs * self.hidden * 2 * self.intermediate + 2.0 * num_pairs * self.intermediate * self.hidden
