"""TMA tensor maps (``cuTensorMapEncodeTiled``), encoded on the host and passed by value."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from megamoe_rt.runtime import driver

_ELEM_BYTES = {"e4m3": 1, "uint8": 1, "bf16": 2, "float32": 4}


@dataclass(frozen=True)
class TensorMap2D:
    raw: ctypes.Array[ctypes.c_uint64]  # 128 opaque bytes as c_uint64 * 16, ready to be a kernel parameter


def validate_2d(
    ptr: int,
    dtype: str,
    *,
    inner: int,
    outer: int,
    row_stride_bytes: int,
    box_inner: int,
    box_outer: int,
    swizzle_128b: bool,
) -> None:
    """The TMA constraints that matter here, checked before the driver sees them."""
    eb = _ELEM_BYTES[dtype]
    if ptr % 16:
        raise ValueError(f"TMA base address {ptr:#x} is not 16-byte aligned")
    if row_stride_bytes % 16 or row_stride_bytes < inner * eb:
        raise ValueError(f"TMA row stride {row_stride_bytes} must be a multiple of 16 and >= {inner * eb}")
    if not (1 <= box_inner <= 256 and 1 <= box_outer <= 256):
        raise ValueError(f"TMA box {box_inner}x{box_outer}: each side must be 1..256")
    if (box_inner * eb) % 16:
        raise ValueError(f"TMA box inner extent {box_inner * eb} bytes must be a multiple of 16")
    if swizzle_128b and box_inner * eb > 128:
        raise ValueError(f"128-byte swizzle needs an inner box of at most 128 bytes, got {box_inner * eb}")
    if inner <= 0 or outer <= 0:
        raise ValueError(f"TMA tensor {inner}x{outer} must be non-empty")


def encode_tensor_map_2d(
    ptr: int,
    dtype: str,
    *,
    inner: int,
    outer: int,
    row_stride_bytes: int,
    box_inner: int,
    box_outer: int,
    swizzle_128b: bool,
) -> TensorMap2D:
    validate_2d(
        ptr,
        dtype,
        inner=inner,
        outer=outer,
        row_stride_bytes=row_stride_bytes,
        box_inner=box_inner,
        box_outer=box_outer,
        swizzle_128b=swizzle_128b,
    )
    from cuda.bindings import driver as cu

    dt = {
        1: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
        2: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        4: cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    }[_ELEM_BYTES[dtype]]
    swz = (
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
        if swizzle_128b
        else cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    )
    tmap = driver.call(
        cu.cuTensorMapEncodeTiled,
        dt,
        2,
        ptr,
        [cu.cuuint64_t(inner), cu.cuuint64_t(outer)],
        [cu.cuuint64_t(row_stride_bytes)],
        [cu.cuuint32_t(box_inner), cu.cuuint32_t(box_outer)],
        [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swz,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        # Rows past the tensor (a tile's tail) read as zeros.
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    raw = (ctypes.c_uint64 * 16).from_buffer_copy(ctypes.string_at(tmap.getPtr(), 128))
    return TensorMap2D(raw)
