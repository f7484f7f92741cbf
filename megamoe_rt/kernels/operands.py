"""FP8 GEMM operands, described once: where the e4m3 rows and their fp32 scales live and how
they are laid out, checked in one place and turned into the TMA tensor maps the kernels load.

Every caller of the GEMM tile loop (the grouped-GEMM planners, the fused plan) describes its
A and B operands with :class:`Fp8Operand`; :func:`weight_operand` and
:func:`activation_operand` build one from user arrays, checking them as they go.

Scale layouts:

- row scales of A (``gran_rows == 1``): one fp32 per row and ``gran_k`` K elements. The kernel
  loads them by TMA from the *k-major* layout ``[K / gran_k, row_stride]`` (rows innermost,
  ``row_stride`` the rows padded to a multiple of 4 so every K group starts 16-byte aligned);
  callers may hold them row-major (``[..., rows, K / gran_k]``) and have a plan re-lay them.
- block scales of B (``gran_rows`` 64 or 128): ``[groups, rows / gran_rows, K / gran_k]``,
  read straight from global memory by the math warpgroups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megamoe_rt.kernels.interface import gemm as gemm_interface
from megamoe_rt.runtime.arrays import DeviceArray, as_device_array, check_array
from megamoe_rt.runtime.tma import TensorMap2D, encode_tensor_map_2d

BLOCK_K = gemm_interface.BLOCK_K.value  # K elements per pipeline stage: one 128-byte swizzled e4m3 row
SCALE_GRANS = (128, 64)


def kmajor_rows(rows: int) -> int:
    """Row stride (in floats) of k-major row scales: rows padded to 4, so each K group's
    row of scales starts 16-byte aligned as TMA needs; at least 4."""
    return max(4, -(-rows // 4) * 4)


@dataclass(frozen=True)
class ScaleFactors:
    """The fp32 scales of an operand."""

    name: str  # argument name, for messages
    ptr: int
    gran_k: int  # K elements sharing one scale: 128 or 64
    gran_rows: int = 1  # operand rows sharing one scale: 1 (per-row) or 64/128 (weight blocks)
    kmajor: bool = False  # [K / gran_k, row_stride] instead of [groups, rows / gran_rows, K / gran_k]
    row_stride: int = 0  # k-major: floats from one K group to the next
    array: DeviceArray | None = None  # the caller's tensor, when there is one

    def shape(self, op: Fp8Operand) -> tuple[int, ...]:
        """The array shape these scales have for operand ``op``."""
        if self.kmajor:
            return (op.k // self.gran_k, self.row_stride)
        lead = (op.groups,) if op.stacked else ()
        return lead + (op.rows // self.gran_rows, op.k // self.gran_k)

    def validate(self, op: Fp8Operand) -> None:
        if self.gran_k not in SCALE_GRANS:
            raise ValueError(f"{self.name}: one scale per {self.gran_k} K elements; expected one of {SCALE_GRANS}")
        if self.gran_rows != 1 and (op.rows <= 0 or op.rows % self.gran_rows):
            raise ValueError(
                f"{op.name}: {op.rows_label} = {op.rows} (shape {list(op.shape)}) must be a positive "
                f"multiple of {self.gran_rows}"
            )
        if self.kmajor:
            if self.gran_rows != 1:
                raise ValueError(f"{self.name}: k-major scales are per row, got one per {self.gran_rows} rows")
            if self.row_stride < op.total_rows or self.row_stride % 4:
                raise ValueError(
                    f"{self.name}: k-major row stride {self.row_stride} must be a multiple of 4 >= {op.total_rows} rows"
                )
        align = 16 if self.kmajor else 4
        if self.array is not None:
            check_array(self.array, self.name, dtypes=("float32",), shape=self.shape(op), device=op.device, align=align)
        elif self.ptr % align:
            raise ValueError(f"{self.name}: data pointer {self.ptr:#x} is not {align}-byte aligned")

    def kmajor_copy(self, op: Fp8Operand, array: DeviceArray) -> ScaleFactors:
        """The same scales re-laid k-major into ``array`` ([K / gran_k, kmajor_rows(rows)])."""
        return dataclasses.replace(self, ptr=array.ptr, kmajor=True, row_stride=kmajor_rows(op.total_rows), array=array)


@dataclass(frozen=True)
class Fp8Operand:
    """An e4m3 GEMM operand: ``groups`` x ``rows`` rows of ``k`` elements, K innermost.

    A is one operand of all its rows (``groups == 1``) in the contiguous layout, or ``stacked``
    ``[G, M_max, K]`` in the masked one; B (the weights) is stacked ``[G, N, K]``. TMA sees
    every operand as one 2-d tensor of ``total_rows`` rows.
    """

    name: str  # argument name, for messages
    ptr: int
    rows: int  # rows per group (A: M or M_max; B: N)
    k: int
    groups: int = 1
    stacked: bool = False  # the array is [groups, rows, k] (else [groups * rows, k])
    row_stride_bytes: int = 0  # 0: packed rows of k bytes
    scales: ScaleFactors | None = None
    array: DeviceArray | None = None  # the caller's tensor, when there is one
    device: int | None = None
    rows_label: str = "M"  # what messages call the rows: M (activations) or N (weights)

    @property
    def total_rows(self) -> int:
        return self.groups * self.rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.groups, self.rows, self.k) if self.stacked else (self.total_rows, self.k)

    @property
    def stride_bytes(self) -> int:
        return self.row_stride_bytes or self.k

    def validate(self) -> None:
        """Raise TypeError/ValueError naming the argument, its shape and what was expected."""
        if self.array is not None:
            check_array(self.array, self.name, dtypes=("e4m3",), shape=self.shape, device=self.device)
        elif self.ptr % 16 and self.total_rows:
            raise ValueError(f"{self.name}: data pointer {self.ptr:#x} is not 16-byte aligned")
        if self.k <= 0 or self.k % BLOCK_K:
            raise ValueError(
                f"{self.name}: K = {self.k} (shape {list(self.shape)}) must be a positive multiple of {BLOCK_K}"
            )
        if self.stride_bytes < self.k or self.stride_bytes % 16:
            raise ValueError(
                f"{self.name}: row stride {self.stride_bytes} bytes must be a multiple of 16 >= K = {self.k}"
            )
        if self.scales is not None:
            self.scales.validate(self)

    def with_scales(self, scales: ScaleFactors) -> Fp8Operand:
        return dataclasses.replace(self, scales=scales)

    def tensor_map(self, box_rows: int, box_k: int = BLOCK_K, swizzle: bool = True) -> TensorMap2D:
        """Tiles of ``box_rows`` x ``box_k`` elements (128-byte swizzled for wgmma by default)."""
        self.validate()
        return encode_tensor_map_2d(
            self.ptr,
            "e4m3",
            inner=self.k,
            outer=self.total_rows,
            row_stride_bytes=self.stride_bytes,
            box_inner=box_k,
            box_outer=box_rows,
            swizzle_128b=swizzle,
        )

    def scale_tensor_map(self, box_rows: int, box_k: int = BLOCK_K) -> TensorMap2D:
        """The k-major row scales of ``box_rows`` rows and ``box_k`` K elements."""
        sf = self.scales
        if sf is None or not sf.kmajor:
            raise ValueError(
                f"{self.name}: TMA loads k-major row scales; this operand has "
                f"{'none' if sf is None else 'row-major ones'}"
            )
        self.validate()
        return encode_tensor_map_2d(
            sf.ptr,
            "float32",
            inner=self.total_rows,
            outer=self.k // sf.gran_k,
            row_stride_bytes=sf.row_stride * 4,
            box_inner=box_rows,
            box_outer=box_k // sf.gran_k,
            swizzle_128b=False,
        )


def weight_operand(
    b: Any, b_sf: Any, *, name: str = "b", sf_name: str = "b_sf", sf_rows: int = 128, stream: int | None = None
) -> Fp8Operand:
    """B ``[G, N, K]`` e4m3 with block scales ``[G, N / sf_rows, K / 128]`` float32, checked."""
    ba = as_device_array(b, name, stream=stream)
    check_array(ba, name, dtypes=("e4m3",), ndim=3)
    groups, n, k = ba.shape
    if groups < 1 or n < 1:
        # A tensor map of no rows cannot be encoded; a GEMM over no weights has nothing to do.
        raise ValueError(f"{name}: expected [G, N, K] with G >= 1 and N >= 1, got shape {list(ba.shape)}")
    sa = as_device_array(b_sf, sf_name, stream=stream)
    scales = ScaleFactors(sf_name, sa.ptr, gran_k=128, gran_rows=sf_rows, array=sa)
    op = Fp8Operand(
        name,
        ba.ptr,
        rows=n,
        k=k,
        groups=groups,
        stacked=True,
        scales=scales,
        array=ba,
        device=ba.device,
        rows_label="N",
    )
    op.validate()
    return op


def activation_operand(
    a: Any,
    a_sf: Any,
    *,
    weights: Fp8Operand,
    masked: bool,
    kmajor: bool = False,
    grans: tuple[int, ...] = SCALE_GRANS,
    name: str = "a",
    sf_name: str = "a_sf",
    stream: int | None = None,
) -> Fp8Operand:
    """A for ``weights``: e4m3 ``[M, K]`` (or ``[G, M_max, K]`` when ``masked``) with per-row scales,
    row-major ``[..., K / gran]`` or, with ``kmajor``, ``[K / gran, kmajor_rows(rows)]``; the
    granularity (one of ``grans``) is read from the scales' shape."""
    groups, kk, dev = weights.groups, weights.k, weights.device
    aa = as_device_array(a, name, stream=stream)
    check_array(aa, name, dtypes=("e4m3",), ndim=3 if masked else 2, device=dev)
    if masked:
        if aa.shape[0] != groups or aa.shape[2] != kk:
            raise ValueError(
                f"{name}: shape {list(aa.shape)} does not match [G={groups}, M_max, K={kk}] of {weights.name}"
            )
        op = Fp8Operand(name, aa.ptr, rows=aa.shape[1], k=kk, groups=groups, stacked=True, array=aa, device=dev)
    else:
        if aa.shape[1] != kk:
            raise ValueError(f"{name}: shape {list(aa.shape)} has K = {aa.shape[1]}, {weights.name} has K = {kk}")
        op = Fp8Operand(name, aa.ptr, rows=aa.shape[0], k=kk, array=aa, device=dev)

    sa = as_device_array(a_sf, sf_name, stream=stream)
    check_array(sa, sf_name, dtypes=("float32",), device=dev, align=16 if kmajor else 4)
    groups_k = [kk // g for g in grans]
    if kmajor:
        stride = kmajor_rows(op.total_rows)
        if sa.ndim != 2 or sa.shape[1] != stride or sa.shape[0] not in groups_k:
            raise ValueError(
                f"{sf_name}: k-major scales must be [{' or '.join(map(str, groups_k))}, {stride}], got {list(sa.shape)}"
            )
        scales = ScaleFactors(sf_name, sa.ptr, gran_k=kk // sa.shape[0], kmajor=True, row_stride=stride, array=sa)
    else:
        lead = list(op.shape[:-1])
        if list(sa.shape[:-1]) != lead or sa.shape[-1] not in groups_k:
            want = " or ".join(f"{lead + [kk // g]} (1x{g} scales)" for g in grans)
            raise ValueError(f"{sf_name}: expected shape {want}, got {list(sa.shape)}")
        scales = ScaleFactors(sf_name, sa.ptr, gran_k=kk // sa.shape[-1], array=sa)
    op = op.with_scales(scales)
    op.validate()
    return op
