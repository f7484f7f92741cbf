"""FP8 GEMM operands: checks and messages, tensor-map geometry (CPU)."""

from __future__ import annotations

import pytest

from megamoe_rt.kernels import grouped_gemm
from megamoe_rt.kernels import operands as ops
from megamoe_rt.kernels.gemm import GemmConfig, GemmLaunch, GemmParams, StoreBf16Params
from megamoe_rt.runtime.arrays import ELEMENT_SIZE, DeviceArray

_next_ptr = [0x7F0000000000]


def _arr(shape, dtype="uint8", device=0) -> DeviceArray:
    """A described (never dereferenced) C-contiguous device array."""
    strides, acc = [], ELEMENT_SIZE[dtype]
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    ptr = _next_ptr[0]
    _next_ptr[0] += -(-acc // 4096) * 4096 + 4096
    return DeviceArray(ptr, tuple(shape), dtype, tuple(reversed(strides)), device)


@pytest.fixture()
def maps(monkeypatch):
    """Record tensor-map encodings instead of calling the driver."""
    calls = []

    def encode(ptr, dtype, **kw):
        calls.append(dict(ptr=ptr, dtype=dtype, **kw))
        return kw

    monkeypatch.setattr(ops, "encode_tensor_map_2d", encode)
    return calls


def plan_grouped_gemm_fp8(*args, **kw):
    # An explicit stream: the default asks CuPy (when another test imported it) for its current one.
    return grouped_gemm.plan_grouped_gemm_fp8(*args, stream=0, **kw)


def plan_grouped_gemm_swiglu_fp8(*args, **kw):
    return grouped_gemm.plan_grouped_gemm_swiglu_fp8(*args, stream=0, **kw)


def _problem(g=2, m=256, n=256, k=256, a_gran=128):
    return _arr((m, k)), _arr((m, k // a_gran), "float32"), _arr((g, n, k)), _arr((g, n // 128, k // 128), "float32")


# --- the messages the public planners keep (tests/gpu/test_gemm_gpu.py checks them on a GPU) ---------


def test_bad_arguments_are_named_before_any_gpu_work():
    a, a_sf, b, b_sf = _problem()
    offs = _arr((3,), "int32")
    with pytest.raises(TypeError, match="a: dtype float32"):
        plan_grouped_gemm_fp8(_arr((256, 256), "float32"), a_sf, b, b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match=r"b: K = 200 \(shape \[2, 256, 200\]\) must be a positive multiple of 128"):
        plan_grouped_gemm_fp8(a, a_sf, _arr((2, 256, 200)), b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match=r"b: N = 200 \(shape \[2, 200, 256\]\)"):
        plan_grouped_gemm_fp8(a, a_sf, _arr((2, 200, 256)), b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match=r"b_sf: expected shape \[2, 2, 2\], got \[2, 2, 3\]"):
        plan_grouped_gemm_fp8(a, a_sf, b, _arr((2, 2, 3), "float32"), group_offsets=offs)
    with pytest.raises(ValueError, match=r"a_sf: expected shape \[256, 2\] \(1x128 scales\) or \[256, 4\]"):
        plan_grouped_gemm_fp8(a, _arr((256, 3), "float32"), b, b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match=r"a: shape \[256, 128\] has K = 128, b has K = 256"):
        plan_grouped_gemm_fp8(_arr((256, 128)), a_sf, b, b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match=r"a: shape \[3, 64, 256\] does not match \[G=2, M_max, K=256\] of b"):
        plan_grouped_gemm_fp8(_arr((3, 64, 256)), a_sf, b, b_sf, masked_counts=_arr((2,), "int32"))
    with pytest.raises(ValueError, match=r"a_sf: k-major scales must be \[2 or 4, 256\], got \[2, 255\]"):
        plan_grouped_gemm_fp8(a, _arr((2, 255), "float32"), b, b_sf, group_offsets=offs, a_sf_kmajor=True)
    with pytest.raises(ValueError, match="b_sf: array is on device 0, expected device 1"):
        plan_grouped_gemm_fp8(a, a_sf, _arr((2, 256, 256), device=1), b_sf, group_offsets=offs)


def test_swiglu_planner_checks_its_operands_the_same_way():
    a, a_sf, _, _ = _problem()
    w1p, w1p_sf = _arr((2, 512, 256)), _arr((2, 8, 2), "float32")
    rw, offs = _arr((256,), "float32"), _arr((3,), "int32")
    with pytest.raises(ValueError, match=r"w1p_sf: expected shape \[2, 8, 2\], got \[2, 4, 2\]"):
        plan_grouped_gemm_swiglu_fp8(a, a_sf, w1p, _arr((2, 4, 2), "float32"), rw, group_offsets=offs)
    with pytest.raises(ValueError, match=r"w1p: N = 2I = 320 .* multiple of 256"):
        plan_grouped_gemm_swiglu_fp8(a, a_sf, _arr((2, 320, 256)), _arr((2, 5, 2), "float32"), rw, group_offsets=offs)
    # The fused epilogue reads 1x128 A scales only.
    with pytest.raises(ValueError, match=r"a_sf: expected shape \[256, 2\] \(1x128 scales\), got \[256, 4\]"):
        plan_grouped_gemm_swiglu_fp8(a, _arr((256, 4), "float32"), w1p, w1p_sf, rw, group_offsets=offs)
    with pytest.raises(
        ValueError, match=r"row_weight: expected at least 256 rows \(one per row of a\), got shape \[255\]"
    ):
        plan_grouped_gemm_swiglu_fp8(a, a_sf, w1p, w1p_sf, _arr((255,), "float32"), group_offsets=offs)


# --- operand descriptions ------------------------------------------------------------------------


def test_activation_scales_granularity_and_layout_come_from_their_shape():
    _, _, b, b_sf = _problem()
    w = ops.weight_operand(b, b_sf)
    assert (w.groups, w.rows, w.k, w.scales.gran_rows, w.scales.gran_k) == (2, 256, 256, 128, 128)
    a = ops.activation_operand(_arr((100, 256)), _arr((100, 4), "float32"), weights=w, masked=False)
    assert (a.total_rows, a.scales.gran_k, a.scales.kmajor) == (100, 64, False)
    km = ops.activation_operand(_arr((100, 256)), _arr((2, 100), "float32"), weights=w, masked=False, kmajor=True)
    assert (km.scales.gran_k, km.scales.kmajor, km.scales.row_stride) == (128, True, 100)
    m = ops.activation_operand(_arr((2, 64, 256)), _arr((2, 64, 2), "float32"), weights=w, masked=True)
    assert (m.stacked, m.rows, m.total_rows, m.shape) == (True, 64, 128, (2, 64, 256))
    assert ops.kmajor_rows(0) == 4 and ops.kmajor_rows(5) == 8 and ops.kmajor_rows(8) == 8


def test_validate_names_the_argument_and_what_was_expected():
    with pytest.raises(ValueError, match=r"x: K = 96 \(shape \[64, 96\]\) must be a positive multiple of 128"):
        ops.Fp8Operand("x", 0x1000, rows=64, k=96).validate()
    with pytest.raises(ValueError, match="x: data pointer 0x1008 is not 16-byte aligned"):
        ops.Fp8Operand("x", 0x1008, rows=64, k=128).validate()
    with pytest.raises(ValueError, match="x: row stride 136 bytes must be a multiple of 16"):
        ops.Fp8Operand("x", 0x1000, rows=64, k=128, row_stride_bytes=136).validate()
    sf = ops.ScaleFactors("x_sf", 0x2000, gran_k=128, kmajor=True, row_stride=60)
    with pytest.raises(ValueError, match="x_sf: k-major row stride 60 must be a multiple of 4 >= 64 rows"):
        ops.Fp8Operand("x", 0x1000, rows=64, k=128, scales=sf).validate()
    with pytest.raises(ValueError, match="x_sf: one scale per 32 K elements"):
        ops.Fp8Operand("x", 0x1000, rows=64, k=128, scales=ops.ScaleFactors("x_sf", 0x2000, gran_k=32)).validate()
    blocks = ops.ScaleFactors("w_sf", 0x2000, gran_k=128, gran_rows=128)
    with pytest.raises(ValueError, match=r"w: N = 192 \(shape \[4, 192, 128\]\) must be a positive multiple of 128"):
        ops.Fp8Operand("w", 0x1000, rows=192, k=128, groups=4, stacked=True, scales=blocks, rows_label="N").validate()
    with pytest.raises(ValueError, match="row-major"):
        ops.Fp8Operand(
            "x", 0x1000, rows=64, k=128, scales=ops.ScaleFactors("x_sf", 0x2000, gran_k=128)
        ).scale_tensor_map(64)


@pytest.mark.parametrize("masked", [False, True])
def test_gemm_launch_tensor_maps(maps, masked):
    """A, B and the k-major A scales as the kernel's TMA boxes expect them."""
    _, _, b, b_sf = _problem(n=512, k=384)
    w = ops.weight_operand(b, b_sf)
    a_arr = _arr((2, 96, 384)) if masked else _arr((200, 384))
    sf = _arr((2, 96, 6) if masked else (200, 6), "float32")
    a = ops.activation_operand(a_arr, sf, weights=w, masked=masked)
    rows = a.total_rows
    copy = _arr((6, ops.kmajor_rows(rows)), "float32")
    a = a.with_scales(a.scales.kmajor_copy(a, copy))
    cfg = GemmConfig(64, 256, 4, a_sf_gran=64, layout="masked" if masked else "contiguous")
    GemmLaunch(cfg, a, w, GemmParams(), StoreBf16Params()).tensor_maps()
    assert maps == [
        dict(
            ptr=a_arr.ptr,
            dtype="e4m3",
            inner=384,
            outer=rows,
            row_stride_bytes=384,
            box_inner=128,
            box_outer=64,
            swizzle_128b=True,
        ),
        dict(
            ptr=b.ptr,
            dtype="e4m3",
            inner=384,
            outer=2 * 512,
            row_stride_bytes=384,
            box_inner=128,
            box_outer=256,
            swizzle_128b=True,
        ),
        dict(
            ptr=copy.ptr,
            dtype="float32",
            inner=rows,
            outer=6,
            row_stride_bytes=4 * ops.kmajor_rows(rows),
            box_inner=64,
            box_outer=2,
            swizzle_128b=False,
        ),
    ]
