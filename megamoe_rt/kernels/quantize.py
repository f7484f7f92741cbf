"""Per-token 1x128 FP8 activation quantization on the GPU (``quantize_fp8``)."""

from __future__ import annotations

from typing import Any

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.interface import quantize as decl
from megamoe_rt.kernels.interface.structs import QuantizeParams as QuantizeParams
from megamoe_rt.kernels.interface.structs import WeightQuantizeParams as WeightQuantizeParams
from megamoe_rt.runtime import devices, streams
from megamoe_rt.runtime.arrays import as_device_array, check_array, cupy_stream, located, require_cupy
from megamoe_rt.schedule.arith import ceil_div

GROUP = decl.GROUP.value
THREADS = decl.THREADS.value
_THREADS_PER_GROUP = 16
_SOURCE = "quantize/quantize_fp8.cu"


def _spec(input_dtype: str) -> KernelSpec:
    is_bf16 = input_dtype == "bf16"
    return KernelSpec(
        name=f"quantize_fp8_1x128[{input_dtype}]",
        source=_SOURCE,
        entry=f"megamoe_rt::quantize_fp8_1x128<{'true' if is_bf16 else 'false'}>",
        block_threads=THREADS,
        expect_sass=("F2FP",),
        params=(QuantizeParams,),
    )


def kernel_specs() -> list[KernelSpec]:
    return [_spec("bf16"), _spec("float32"), _weight_spec("bf16"), _weight_spec("float32")]


def quantize_fp8(x: Any, *, out: Any = None, out_sf: Any = None, stream: Any = None) -> tuple[Any, Any]:
    """Quantize activations to e4m3 with per-token 1x128 fp32 scales.

    ``x``: bf16 or fp32 ``[T, H]`` CUDA array (bf16 as raw-bit ``uint16`` for
    CuPy, or a native bfloat16 DLPack tensor), H a multiple of 128.
    Returns ``(q, sf)``: ``q`` uint8 ``[T, H]`` (raw e4m3 codes), ``sf`` float32
    ``[T, H/128]``, with ``scale = max(amax, 1e-4) / 448`` per group. ``out`` /
    ``out_sf`` may be given to write in place. Runs on ``stream`` (default:
    CuPy's current stream) with no host synchronisation.
    """
    sh = streams.stream_handle(stream)
    xa = located(as_device_array(x, "x", stream=sh), "x")
    dtype = check_array(xa, "x", dtypes=("bf16", "float32"), ndim=2)
    rows, hidden = xa.shape
    if hidden % GROUP:
        raise ValueError(f"x: hidden size {hidden} (shape {list(xa.shape)}) must be a multiple of {GROUP}")
    info = devices.require_hopper(xa.device)
    cupy = require_cupy()
    with cupy.cuda.Device(info.ordinal), cupy_stream(cupy, sh):
        q = cupy.empty((rows, hidden), dtype=cupy.uint8) if out is None else out
        sf = cupy.empty((rows, hidden // GROUP), dtype=cupy.float32) if out_sf is None else out_sf
    qa = as_device_array(q, "out")
    check_array(qa, "out", dtypes=("e4m3",), shape=(rows, hidden), align=8, device=info.ordinal)
    sfa = as_device_array(sf, "out_sf")
    check_array(sfa, "out_sf", dtypes=("float32",), shape=(rows, hidden // GROUP), align=4, device=info.ordinal)
    num_groups = rows * (hidden // GROUP)
    if num_groups == 0:
        return q, sf
    from megamoe_rt.kernels.loader import get_kernel

    kernel = get_kernel(_spec(dtype), info.ordinal)
    params = QuantizeParams(xa.ptr, qa.ptr, sfa.ptr, num_groups, hidden // GROUP, 0)
    groups_per_block = THREADS // _THREADS_PER_GROUP
    # Enough blocks for ~16 resident per SM; the kernel strides over the rest.
    blocks = min(ceil_div(num_groups, groups_per_block), info.sm_count * 16)
    kernel.launch((blocks,), (THREADS,), [params], stream=sh)
    return q, sf


# --- 128x128 weight blocks -------------------------------------------------------------------

_WEIGHT_SOURCE = "quantize/quantize_weight_fp8.cu"
_WEIGHT_THREADS = decl.WEIGHT_THREADS.value


def _weight_spec(input_dtype: str) -> KernelSpec:
    return KernelSpec(
        name=f"quantize_fp8_128x128[{input_dtype}]",
        source=_WEIGHT_SOURCE,
        entry=f"megamoe_rt::quantize_fp8_128x128<{'true' if input_dtype == 'bf16' else 'false'}>",
        block_threads=_WEIGHT_THREADS,
        expect_sass=("F2FP",),
        params=(WeightQuantizeParams,),
    )


def quantize_weight_fp8(w: Any, *, stream: Any = None) -> tuple[Any, Any]:
    """Quantize weights ``[..., N, K]`` (bf16 bits as uint16, or fp32; N, K multiples of 128)
    to e4m3 codes (uint8, same shape) and fp32 128x128 block scales ``[..., N/128, K/128]``."""
    sh = streams.stream_handle(stream)
    wa = located(as_device_array(w, "w", stream=sh), "w")
    dtype = check_array(wa, "w", dtypes=("bf16", "float32"))
    if wa.ndim < 2 or wa.shape[-1] % GROUP or wa.shape[-2] % GROUP or 0 in wa.shape:
        raise ValueError(f"w: expected [..., N, K] with N and K positive multiples of {GROUP}, got {list(wa.shape)}")
    n, k = wa.shape[-2:]
    lead = tuple(wa.shape[:-2])
    groups = 1
    for d in lead:
        groups *= d
    info = devices.require_hopper(wa.device)
    cupy = require_cupy()
    with cupy.cuda.Device(info.ordinal), cupy_stream(cupy, sh):
        q = cupy.empty(wa.shape, dtype=cupy.uint8)
        sf = cupy.empty(lead + (n // GROUP, k // GROUP), dtype=cupy.float32)
    from megamoe_rt.kernels.loader import get_kernel

    num_blocks = groups * (n // GROUP) * (k // GROUP)
    params = WeightQuantizeParams(wa.ptr, int(q.data.ptr), int(sf.data.ptr), n, k, num_blocks, 0)
    get_kernel(_weight_spec(dtype), info.ordinal).launch(
        (min(num_blocks, info.sm_count * 8),), (_WEIGHT_THREADS,), [params], stream=sh
    )
    return q, sf
