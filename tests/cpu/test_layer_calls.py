"""A layer call's argument checks (megamoe_rt/layer_calls.py): the short path a decode loop takes
passes exactly what the full checks pass, with the same call, and leaves everything else to them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.layer_calls import CallChecks

H, K, CAP, DEV = 256, 4, 64, 1
ITEMSIZE = {"|u1": 1, "<u1": 1, ">u1": 1, "<f4": 4, "<i4": 4, "<i8": 8, "<u2": 2, "<f2": 2, "|b1": 1}


class CaiArray:
    """A CUDA array as CuPy exports one: the interface is a property built on every access."""

    def __init__(self, shape, typestr, ptr, *, device=DEV, strides=None, mask=None, device_attr="id"):
        self.shape, self.typestr, self.ptr, self.strides, self.mask = shape, typestr, ptr, strides, mask
        self.device = SimpleNamespace(**{device_attr: device})

    @property
    def __cuda_array_interface__(self):
        cai = {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False), "version": 3}
        if self.strides is not None:
            cai["strides"] = self.strides
        if self.mask is not None:
            cai["mask"] = self.mask
        return cai


def _good(t=8, idx="<i4"):
    """A valid call's five arrays, each in its own 1 MiB-aligned range."""
    return [
        CaiArray((t, H), "|u1", 1 << 20),
        CaiArray((t, H // 128), "<f4", 2 << 20),
        CaiArray((t, K), idx, 3 << 20),
        CaiArray((t, K), "<f4", 4 << 20),
        CaiArray((t, H), "<u2", 5 << 20),
    ]


def _outcome(fn):
    try:
        return "ok", fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)


def test_a_decode_call_takes_the_short_path_with_the_full_paths_call():
    checks = CallChecks(H, K, CAP, DEV)
    for idx in ("<i4", "<i8"):
        arrays = _good(idx=idx)
        passed = checks._passing_batch(*arrays)
        assert passed is not None
        call, y = checks.batch(*arrays, 0, 32)
        assert y is arrays[4] and call.bound == 32
        assert (call, y) == checks._checked_batch(*arrays, 0, 32)


# One change to one argument of a valid call: what the short path must either pass with the full
# path's result or leave to it.
CHANGES = st.sampled_from(
    [
        ("typestr", ["<u1", ">u1", "<f2", "|b1", "<i8", "<u2", "<f4"]),
        ("rows", [0, 1, 7, 9, CAP, CAP + 1]),
        ("cols", [1, 2, K + 1, H // 128 + 1, H - 1, H + 16]),
        ("ptr", [8, 4, 2, 1, 12, 5 << 20, (5 << 20) + 16, (1 << 20) + 64]),
        ("device", [0, 2]),
        ("device_attr", ["index", "name"]),
        ("strides", ["c", "f", "padded"]),
        ("mask", [object()]),
        ("none", [None]),
    ]
)


@settings(max_examples=400, deadline=None)
@given(which=st.integers(0, 4), change=CHANGES, pick=st.integers(0, 7), bound=st.sampled_from([None, 8, 64, 65]))
def test_the_short_path_never_passes_what_the_full_checks_refuse(which, change, pick, bound):
    checks = CallChecks(H, K, CAP, DEV)
    arrays = _good()
    a = arrays[which]
    field, values = change
    value = values[pick % len(values)]
    if field == "none":
        arrays[which] = None
    elif field in ("rows", "cols"):
        rows, cols = a.shape
        a.shape = (value, cols) if field == "rows" else (rows, value)
        if field == "rows" and which == 0:  # the call's token count: every array follows
            for other in arrays[1:]:
                other.shape = (value, other.shape[1])
    elif field == "strides":
        rows, cols = a.shape
        size = ITEMSIZE[a.typestr]
        a.strides = {"c": (cols * size, size), "f": (size, rows * size), "padded": ((cols + 8) * size, size)}[value]
    elif field == "device_attr":
        arrays[which] = CaiArray(a.shape, a.typestr, a.ptr, device_attr=value)
    else:
        setattr(a, field, value)
    if checks._passing_batch(*arrays) is None:
        return  # left to the full checks, whatever they say (out=None: they allocate one)
    full = _outcome(lambda: checks._checked_batch(*arrays, 0, bound))
    # Passed arrays are arrays the full checks pass: all they may still refuse is the bound,
    # which the short path checks with the same function.
    assert full[0] == "ok" or full[1].startswith("num_tokens_bound="), (field, value, full)
    assert _outcome(lambda: checks.batch(*arrays, 0, bound)) == full


def test_the_output_over_an_input_is_left_to_the_full_checks_which_name_the_pair():
    checks = CallChecks(H, K, CAP, DEV)
    arrays = _good()
    arrays[4].ptr = arrays[3].ptr  # out over topk_weights
    assert checks._passing_batch(*arrays) is None
    with pytest.raises(ValueError, match="^out: overlaps topk_weights"):
        checks.batch(*arrays, 0, None)


def _cupy_array(cupy, shape, dtype, base, *, device=DEV):
    """A ``cupy.ndarray`` over memory at ``base`` it does not own: built, sliced and described
    without a GPU (CuPy asks the driver only to allocate, copy or run)."""
    from cupy.cuda.memory import MemoryPointer, UnownedMemory

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return cupy.ndarray(shape, dtype=dtype, memptr=MemoryPointer(UnownedMemory(base, nbytes, None, device), 0))


def test_cupy_arrays_are_read_from_their_attributes_as_their_interface_describes_them():
    """A CuPy array's short-path description (its attributes; its interface would ask the CUDA
    runtime) against what the array is: pointer with the view's offset, rows, columns, item
    size; None for what the interface would show strided, another type, rank or device."""
    cupy = pytest.importorskip("cupy")
    from megamoe_rt.runtime.arrays import plain_2d

    x = _cupy_array(cupy, (8, H), np.uint8, 1 << 20)
    ids = _cupy_array(cupy, (8, K), np.int64, 3 << 20)
    assert plain_2d(x, ("|u1", "<u1"), DEV) == (1 << 20, 8, H, 1)
    assert plain_2d(ids, ("<i4", "<i8"), DEV) == (3 << 20, 8, K, 8)
    assert plain_2d(x[2:5], ("|u1",), DEV) == ((1 << 20) + 2 * H, 3, H, 1)  # a row range: same layout, offset
    assert plain_2d(x[:, ::2], ("|u1",), DEV) is None  # strided
    assert plain_2d(x.T, ("|u1",), DEV) is None  # column-major
    assert plain_2d(x.reshape(8 * H), ("|u1",), DEV) is None  # 1-D
    assert plain_2d(x, ("<f4",), DEV) is None  # another type
    assert plain_2d(x, ("|u1",), DEV + 1) is None  # on another device
    assert plain_2d(x[:0], ("|u1",), DEV) is None  # empty: its interface says pointer 0
    assert plain_2d(_cupy_array(cupy, (8, H), np.uint8, 1 << 20, device=DEV + 1), ("|u1",), DEV + 1)[0] == 1 << 20


def test_a_stand_in_cupy_module_leaves_arrays_to_their_interfaces(monkeypatch):
    import sys
    from types import ModuleType

    from megamoe_rt.runtime import arrays

    monkeypatch.setattr(arrays, "_cupy_ndarray", None)
    monkeypatch.setitem(sys.modules, "cupy", ModuleType("cupy"))  # no ndarray
    a = CaiArray((8, H), "|u1", 1 << 20)
    assert arrays.plain_2d(a, ("|u1",), DEV) == (1 << 20, 8, H, 1)
    assert arrays._cupy_ndarray is None  # nothing cached from the stand-in


def test_a_decode_call_of_cupy_arrays_takes_the_short_path_with_the_full_paths_values():
    cupy = pytest.importorskip("cupy")
    checks = CallChecks(H, K, CAP, DEV)
    t = 8
    arrays = [
        _cupy_array(cupy, (t, H), np.uint8, 1 << 20),
        _cupy_array(cupy, (t, H // 128), np.float32, 2 << 20),
        _cupy_array(cupy, (t, K), np.int32, 3 << 20),
        _cupy_array(cupy, (t, K), np.float32, 4 << 20),
        _cupy_array(cupy, (t, H), np.uint16, 5 << 20),
    ]
    call = checks._passing_batch(*arrays)
    assert call is not None
    assert (call.x, call.x_sf, call.topk_idx, call.topk_weights, call.y) == tuple(i << 20 for i in range(1, 6))
    assert (call.num_tokens, call.idx) == (t, "int32")
    # The same arrays as bare interfaces take the same short path to the same call.
    described = [CaiArray(a.shape, a.dtype.str, a.data.ptr) for a in arrays]
    assert checks._passing_batch(*described) == call
