"""Device arrays in and out: ``__cuda_array_interface__`` and DLPack.

CuPy has no float8 or bfloat16 dtype, so e4m3 data travels as ``uint8`` arrays
of raw e4m3 bytes and bf16 as ``uint16`` arrays of raw bf16 bits. DLPack
tensors that carry native ``float8_e4m3fn`` / ``bfloat16`` dtypes (PyTorch,
JAX) are read zero-copy. Every array a kernel sees is described by a
:class:`DeviceArray`: pointer, shape, element type, byte strides, device.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from megamoe_rt.runtime.errors import INSTALL_HINT

# Canonical element-type names used across the package.
ELEMENT_SIZE = {
    "e4m3": 1,
    "uint8": 1,
    "int8": 1,
    "bf16": 2,
    "uint16": 2,
    "float16": 2,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "float64": 8,
    "int64": 8,
    "uint64": 8,
}

# What a raw-bits container may stand for (docs/NUMERICS.md, "How the formats travel").
RAW_BITS_ALIASES = {"uint8": "e4m3", "uint16": "bf16"}

_TYPESTR = {
    "u1": "uint8",
    "i1": "int8",
    "u2": "uint16",
    "f2": "float16",
    "i4": "int32",
    "u4": "uint32",
    "f4": "float32",
    "f8": "float64",
    "i8": "int64",
    "u8": "uint64",
}
# Bools ("b1") are deliberately absent: a bool array is never a container of e4m3 codes.


@dataclass(frozen=True)
class DeviceArray:
    """A borrowed view of device memory. ``owner`` keeps the producer alive."""

    ptr: int
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...]  # in bytes
    device: int | None
    owner: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # Python ints: exact, and ~20x cheaper than np.prod per call

    @property
    def itemsize(self) -> int:
        return ELEMENT_SIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def is_c_contiguous(self) -> bool:
        if self.size == 0:
            return True  # no element to misplace (NumPy and CuPy say the same)
        expect = self.itemsize
        for dim, stride in zip(reversed(self.shape), reversed(self.strides)):
            if dim != 1 and stride != expect:
                return False
            expect *= dim
        return True


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _from_cai(obj: Any, cai: Any, name: str) -> DeviceArray:
    typestr = cai["typestr"]
    order, key = typestr[:1], typestr[1:]
    if key not in _TYPESTR:
        raise TypeError(f"{name}: unsupported __cuda_array_interface__ typestr {typestr!r}")
    if order == ">" and key[1:] != "1":  # GPUs are little-endian: byte-swapped data would be misread
        raise TypeError(f"{name}: byte-swapped (big-endian) data is not supported, got typestr {typestr!r}")
    dtype = _TYPESTR[key]
    shape = tuple(int(s) for s in cai["shape"])
    strides = cai.get("strides")
    strides = _c_strides(shape, ELEMENT_SIZE[dtype]) if strides is None else tuple(int(s) for s in strides)
    ptr = int(cai["data"][0])
    return DeviceArray(ptr, shape, dtype, strides, producer_device(obj), owner=obj)


def producer_device(obj: Any) -> int | None:
    """The device an array object says it is on, or None when it does not say."""
    dev = getattr(obj, "device", None)
    # CuPy devices have .id; torch devices .index (None for the current device).
    for attr in ("id", "index"):
        value = getattr(dev, attr, None) if dev is not None else None
        if isinstance(value, int):
            return value
    return None


_cupy_ndarray: type | None = None


def _is_cupy_ndarray(obj: Any) -> bool:
    """Whether ``obj`` is exactly a ``cupy.ndarray`` (CuPy is looked up only once imported: an
    object of its class cannot exist before)."""
    global _cupy_ndarray
    if _cupy_ndarray is None:
        ndarray = getattr(sys.modules.get("cupy"), "ndarray", None)
        if not isinstance(ndarray, type):  # not imported, or a stand-in module
            return False
        _cupy_ndarray = ndarray
    return type(obj) is _cupy_ndarray


def _plain_2d_cupy(arr: Any, typestrs: tuple[str, ...], device: int) -> tuple[int, int, int, int] | None:
    """:func:`plain_2d` of a ``cupy.ndarray``, from its attributes: what its interface would say
    (type string ``dtype.str``, pointer ``data.ptr``, strides only when not C-contiguous, never a
    mask, device ``data.device_id``) without building the dictionary, which asks the CUDA runtime
    for the current device and stream on every access."""
    shape = arr.shape
    # An empty array's interface says pointer 0: left to the interface path.
    if len(shape) != 2 or not shape[0] or not shape[1]:
        return None
    if arr.dtype.str not in typestrs or not arr.flags.c_contiguous:
        return None
    memory = arr.data
    if memory.device_id != device:
        return None
    return memory.ptr, shape[0], shape[1], arr.itemsize


def plain_2d(obj: Any, typestrs: tuple[str, ...], device: int) -> tuple[int, int, int, int] | None:
    """(pointer, rows, columns, itemsize) of an array that describes itself by
    ``__cuda_array_interface__`` (read once) as 2-D, C-contiguous (no strides, or exactly the C
    strides), unmasked, of a type string in ``typestrs`` (numpy's spellings), on ``device`` by its
    own word; else None. The cheap test a call's arrays pass before the full description above.
    A CuPy array is read from its attributes, which say the same (tests/cpu/test_layer_calls.py)."""
    if _is_cupy_ndarray(obj):
        return _plain_2d_cupy(obj, typestrs, device)
    try:
        cai = obj.__cuda_array_interface__
        typestr, shape, ptr = cai["typestr"], cai["shape"], cai["data"][0]
        strides, mask = cai.get("strides"), cai.get("mask")
    except Exception:
        return None
    if typestr not in typestrs or mask is not None or len(shape) != 2 or type(ptr) is not int:
        return None
    rows, cols = shape
    if type(rows) is not int or type(cols) is not int or producer_device(obj) != device:
        return None
    itemsize = ELEMENT_SIZE[_TYPESTR[typestr[1:]]]
    if strides is not None and tuple(strides) != (cols * itemsize, itemsize):
        return None
    return ptr, rows, cols, itemsize


# --- DLPack (read-only consumer; the capsule stays alive with the view) ------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DL_CUDA = 2
_DL_CUDA_MANAGED = 13
# (type code, bits) -> element type; codes from dlpack.h (kDLInt=0, kDLUInt=1, kDLFloat=2,
# kDLBfloat=4, kDLFloat8_e4m3fn=10).
_DL_DTYPES = {
    (0, 8): "int8",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (1, 16): "uint16",
    (1, 32): "uint32",
    (1, 64): "uint64",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bf16",
    (10, 8): "e4m3",
}

_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any, name: str, stream: int | None) -> DeviceArray:
    dev_type, dev_id = obj.__dlpack_device__()
    if int(dev_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(f"{name}: expected a CUDA device array, got a DLPack tensor on device type {int(dev_type)}")
    try:
        capsule = obj.__dlpack__(stream=stream if stream else None)
    except TypeError:
        capsule = obj.__dlpack__()
    # The managed tensor starts with its DLTensor; we never take ownership (the
    # capsule, kept as owner, frees it), so the producer's memory stays valid.
    addr = _capsule_get_pointer(capsule, b"dltensor")
    t = _DLTensor.from_address(addr)
    if t.dtype.lanes != 1:
        raise TypeError(f"{name}: vector DLPack dtypes (lanes={t.dtype.lanes}) are not supported")
    key = (int(t.dtype.code), int(t.dtype.bits))
    if key not in _DL_DTYPES:
        raise TypeError(f"{name}: unsupported DLPack dtype (code={key[0]}, bits={key[1]})")
    dtype = _DL_DTYPES[key]
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    if t.strides:
        strides = tuple(int(t.strides[i]) * ELEMENT_SIZE[dtype] for i in range(t.ndim))
    else:
        strides = _c_strides(shape, ELEMENT_SIZE[dtype])
    ptr = int(t.data or 0) + int(t.byte_offset)
    return DeviceArray(ptr, shape, dtype, strides, int(dev_id), owner=(obj, capsule))


def as_device_array(obj: Any, name: str, *, stream: int | None = None) -> DeviceArray:
    """Describe ``obj`` (CuPy array, CAI object or DLPack CUDA tensor) as a DeviceArray."""
    if isinstance(obj, DeviceArray):
        return obj
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{name}: expected a device array (CuPy or DLPack CUDA tensor), got a host numpy.ndarray")
    dlpack = hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")
    try:
        # Read once: CuPy and torch build the dictionary on every access (a call reads five).
        cai = getattr(obj, "__cuda_array_interface__", None)
    except Exception as exc:
        # getattr only absorbs AttributeError: torch's property raises KeyError for dtypes the
        # interface has no type string for (float8_e4m3fn). DLPack carries those natively.
        if not dlpack:
            raise TypeError(f"{name}: its __cuda_array_interface__ failed ({type(exc).__name__}: {exc})") from None
        cai = None
    if cai is not None:
        try:
            return _from_cai(obj, cai, name)
        except (AttributeError, TypeError, ValueError) as exc:
            # torch describes bf16 as an opaque '<V2'; DLPack carries bf16 and fp8 natively.
            if not dlpack:
                text = str(exc)
                raise TypeError(text if text.startswith(f"{name}:") else f"{name}: {text}") from None
    if dlpack:
        return _from_dlpack(obj, name, stream)
    raise TypeError(
        f"{name}: expected a CUDA array (CuPy, __cuda_array_interface__ or DLPack), got {type(obj).__name__}"
    )


def logical_dtype(arr: DeviceArray) -> str:
    """The element type an array stands for under the raw-bits contract."""
    return RAW_BITS_ALIASES.get(arr.dtype, arr.dtype)


def check_array(
    arr: DeviceArray,
    name: str,
    *,
    dtypes: Iterable[str],
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = True,
    device: int | None = None,
    align: int = 16,
) -> str:
    """Validate and return the logical dtype; raise ValueError/TypeError naming ``name``."""
    allowed = tuple(dtypes)
    ldt = logical_dtype(arr)
    if ldt not in allowed and arr.dtype not in allowed:
        raise TypeError(
            f"{name}: dtype {arr.dtype} (shape {arr.shape}) is not supported; expected one of {', '.join(allowed)}"
        )
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {arr.shape}")
    if shape is not None and (
        len(shape) != arr.ndim or any(s is not None and s != a for s, a in zip(shape, arr.shape))
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(arr.shape)} ({arr.dtype})")
    if contiguous and not arr.is_c_contiguous():
        raise ValueError(
            f"{name}: expected a C-contiguous array, got shape {arr.shape} with byte strides {arr.strides}"
        )
    if device is not None and arr.device is None and arr.size:
        # The producer did not say (a bare __cuda_array_interface__): ask the driver.
        arr = located(arr, name)
    if device is not None and arr.device is not None and arr.device != device:
        raise ValueError(f"{name}: array is on device {arr.device}, expected device {device}")
    if align > 1 and arr.ptr % align and arr.size:
        raise ValueError(f"{name}: data pointer {arr.ptr:#x} is not {align}-byte aligned (vector loads need it)")
    return ldt if ldt in allowed else arr.dtype


def located(arr: DeviceArray, name: str) -> DeviceArray:
    """``arr`` with its device known: the producer's word, else the driver's for its pointer
    (host memory and addresses CUDA does not know are refused, naming ``name``)."""
    from megamoe_rt.runtime import driver

    if arr.device is not None or not arr.size or not driver.driver_available():
        return arr
    where, ordinal = driver.pointer_location(arr.ptr)
    if where == "host":
        raise ValueError(f"{name}: data pointer {arr.ptr:#x} is host memory; expected device memory")
    if where == "unknown":
        raise ValueError(f"{name}: data pointer {arr.ptr:#x} is not memory CUDA allocated, mapped or registered")
    return DeviceArray(arr.ptr, arr.shape, arr.dtype, arr.strides, ordinal, owner=arr.owner)


def require_cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise RuntimeError(f"CuPy is needed to allocate outputs; install: {INSTALL_HINT}") from None
    return cupy


class _StreamHandle:
    def __init__(self, handle: int):
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def cupy_stream(cupy: Any, handle: int) -> Any:
    """A CuPy stream object for a raw handle (0: the legacy default stream)."""
    if not handle:
        return cupy.cuda.Stream.null
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle)


def byte_span(arr: DeviceArray) -> tuple[int, int]:
    """``[first, last)`` bytes an array's elements occupy (any strides)."""
    if arr.size == 0:
        return arr.ptr, arr.ptr
    lo = hi = 0
    for dim, stride in zip(arr.shape, arr.strides):
        reach = (dim - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return arr.ptr + lo, arr.ptr + hi + arr.itemsize


def check_disjoint(out: DeviceArray, name: str, inputs: dict[str, DeviceArray | None]) -> None:
    """Raise ValueError when ``out`` shares memory with one of ``inputs``: the kernels read
    the inputs while they write ``out``, so an output over an input gives a wrong answer."""
    o_lo, o_hi = byte_span(out)
    if o_lo == o_hi:
        return
    for other, arr in inputs.items():
        if arr is None:
            continue
        lo, hi = byte_span(arr)
        if lo < o_hi and o_lo < hi and lo < hi:  # an empty input occupies no byte
            raise ValueError(
                f"{name}: overlaps {other} (bytes {o_lo:#x}..{o_hi:#x} against {lo:#x}..{hi:#x}); "
                "the output must not share memory with an input"
            )
