"""Array interop: __cuda_array_interface__ and DLPack descriptions, validation messages."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.runtime.arrays import DeviceArray, as_device_array, check_array, logical_dtype


class FakeCai:
    def __init__(self, shape, typestr, ptr=0x10000, strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": strides,
        }


def test_cai_parsing_and_raw_bit_aliases():
    a = as_device_array(FakeCai((8, 256), "<u2"), "x")
    assert (a.shape, a.dtype, a.strides, a.ptr) == ((8, 256), "uint16", (512, 2), 0x10000)
    assert logical_dtype(a) == "bf16" and a.is_c_contiguous() and a.nbytes == 8 * 256 * 2
    q = as_device_array(FakeCai((8, 256), "|u1"), "q")
    assert logical_dtype(q) == "e4m3"


def test_non_contiguous_is_rejected_with_name():
    a = as_device_array(FakeCai((8, 256), "<f4", strides=(2048, 4)), "x")
    assert not a.is_c_contiguous()
    with pytest.raises(ValueError, match="x: expected a C-contiguous"):
        check_array(a, "x", dtypes=("float32",))


def test_validation_messages_name_argument_shape_and_dtype():
    a = as_device_array(FakeCai((8, 256), "<i4"), "topk_idx")
    with pytest.raises(TypeError, match=r"x: dtype int32 \(shape \(8, 256\)\)"):
        check_array(a, "x", dtypes=("bf16", "float32"))
    with pytest.raises(ValueError, match=r"w: expected shape \[8, 128\], got \[8, 256\]"):
        check_array(a, "w", dtypes=("int32",), shape=(8, 128))
    with pytest.raises(ValueError, match="3-d"):
        check_array(a, "w", dtypes=("int32",), ndim=3)
    misaligned = as_device_array(FakeCai((8, 256), "<i4", ptr=0x10004), "m")
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_array(misaligned, "m", dtypes=("int32",))


def test_host_arrays_are_rejected():
    with pytest.raises(TypeError, match="host numpy"):
        as_device_array(np.zeros((2, 2), np.float32), "x")
    with pytest.raises(TypeError, match="x: expected a CUDA array"):
        as_device_array([1, 2, 3], "x")


def test_cpu_dlpack_tensor_is_rejected():
    with pytest.raises(TypeError, match="CUDA device array"):
        as_device_array(_DLPackOnly(np.ones((4, 4), np.float32)), "x")


class _DLPackOnly:
    """Exposes only the DLPack protocol of a host array (device type 1 = CPU)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, stream=None):
        return self._arr.__dlpack__()

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_dlpack_struct_reader_on_host_capsule(monkeypatch):
    # The capsule layout is the same for every device; read a host one through
    # the CUDA path by pretending the device type is CUDA.
    import megamoe_rt.runtime.arrays as arrays

    host = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]

    class Pretend(_DLPackOnly):
        def __dlpack_device__(self):
            return (2, 0)

    arr = arrays.as_device_array(Pretend(host), "x")
    assert isinstance(arr, DeviceArray)
    assert arr.shape == (4, 3) and arr.dtype == "float32" and arr.device == 0
    assert arr.ptr == host.ctypes.data
    assert arr.strides == host.strides == (24, 8) and not arr.is_c_contiguous()
    ints = np.arange(10, dtype=np.int64)
    assert arrays.as_device_array(Pretend(ints), "i").dtype == "int64"


def test_device_from_cupy_and_torch_style_objects():
    class Dev:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    a = FakeCai((4, 4), "<f4")
    a.device = Dev(id=1)
    assert as_device_array(a, "a").device == 1
    b = FakeCai((4, 4), "<f4")
    b.device = Dev(index=2, type="cuda")
    assert as_device_array(b, "b").device == 2


def test_cai_that_cannot_name_its_dtype_falls_back_to_dlpack():
    # torch's __cuda_array_interface__ raises KeyError for float8 tensors (and is '<V2' for bf16),
    # which hasattr() does not absorb; the DLPack path must still be taken.
    import megamoe_rt.runtime.arrays as arrays

    host = np.arange(12, dtype=np.uint8).reshape(3, 4)

    class Float8Like(_DLPackOnly):
        @property
        def __cuda_array_interface__(self):
            raise KeyError("torch.float8_e4m3fn")

        def __dlpack_device__(self):
            return (2, 0)

    arr = arrays.as_device_array(Float8Like(host), "x")
    assert (arr.shape, arr.dtype, arr.ptr) == ((3, 4), "uint8", host.ctypes.data)

    class Opaque(_DLPackOnly):
        __cuda_array_interface__ = {"shape": (3, 4), "typestr": "<V2", "data": (0x10000, False), "version": 3}

        def __dlpack_device__(self):
            return (2, 0)

    assert arrays.as_device_array(Opaque(host), "x").ptr == host.ctypes.data

    class NoDLPack:
        @property
        def __cuda_array_interface__(self):
            raise KeyError("torch.float8_e4m3fn")

    with pytest.raises(TypeError, match="w: its __cuda_array_interface__ failed"):
        arrays.as_device_array(NoDLPack(), "w")


def test_bools_and_byte_swapped_data_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match=r"x: unsupported __cuda_array_interface__ typestr '\|b1'"):
        as_device_array(FakeCai((8, 256), "|b1"), "x")
    with pytest.raises(TypeError, match=r"x_sf: byte-swapped \(big-endian\) data is not supported, got typestr '>f4'"):
        as_device_array(FakeCai((8, 2), ">f4"), "x_sf")
    assert as_device_array(FakeCai((8, 2), "=f4"), "x_sf").dtype == "float32"
    assert as_device_array(FakeCai((8, 256), ">u1"), "x").dtype == "uint8"  # one byte has no order
