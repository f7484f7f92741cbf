"""A rank's expert weights, checked and copied into device arrays the layer owns.

The caller's arrays are in the plain layout of docs/NUMERICS.md (NumPy or any CUDA array; e4m3
as ml_dtypes or uint8 bytes); the layer keeps its own copies (never the caller's array, which
the caller may reuse) and re-lays ``w1`` for the SwiGLU epilogue.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megamoe_rt.kernels.grouped_gemm import prepare_swiglu_weights
from megamoe_rt.modes.base import Weights
from megamoe_rt.runtime.arrays import as_device_array, check_array, cupy_stream, require_cupy

WEIGHT_NAMES = ("w1", "w1_sf", "w2", "w2_sf")


def weight_shapes(num_local_experts: int, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """The shape of each weight array a rank passes."""
    e, h, i = num_local_experts, hidden, intermediate
    return {
        "w1": (e, 2 * i, h),
        "w1_sf": (e, 2 * i // 128, h // 128),
        "w2": (e, h, i),
        "w2_sf": (e, h // 128, i // 128),
    }


def device_weights(given: dict[str, Any], shapes: dict[str, tuple[int, ...]], device: int, stream: int) -> Weights:
    """Device copies of ``given`` (by name), checked against ``shapes``, on ``stream``."""
    cupy = require_cupy()
    with cupy.cuda.Device(device), cupy_stream(cupy, stream):
        arrays = {n: _to_device(cupy, n, given[n], shapes[n], n.endswith("_sf"), device, stream) for n in WEIGHT_NAMES}
        w1, w1_sf = prepare_swiglu_weights(arrays["w1"], arrays["w1_sf"])
        return Weights(w1, w1_sf, arrays["w2"], arrays["w2_sf"])


def copy_weights(dst: Weights, src: Weights, device: int, stream: int) -> None:
    """Copy ``src`` into ``dst``'s arrays on ``stream`` (a reload keeps the addresses)."""
    cupy = require_cupy()
    with cupy.cuda.Device(device), cupy_stream(cupy, stream):
        for d, s in zip(dst, src):
            d[...] = s


def _to_device(cupy, name: str, arr: Any, shape: tuple, is_sf: bool, device: int, stream: int):
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
