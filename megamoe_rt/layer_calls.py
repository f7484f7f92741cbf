"""A layer call's arguments checked into a :class:`~megamoe_rt.modes.base.Call`.

Every check runs on the host before anything is launched and raises naming the argument, its
shape or dtype and what was expected (ValueError / TypeError); the device checks only what the
host cannot see without a wait (the expert ids, reported later: megamoe_rt/layer_reports.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megamoe_rt.modes.base import Call
from megamoe_rt.runtime import args
from megamoe_rt.runtime.arrays import (
    as_device_array,
    check_array,
    check_disjoint,
    cupy_stream,
    plain_2d,
    require_cupy,
)

# Type strings a call's arrays pass with on the short path (numpy's spellings, which CuPy
# exports); any other spelling takes the full path, which knows them all and names what is wrong.
_E4M3_TYPESTRS = ("|u1", "<u1")  # e4m3 codes in a uint8 container
_F32_TYPESTRS = ("<f4",)
_ID_TYPESTRS = ("<i4", "<i8")
_BF16_TYPESTRS = ("<u2",)  # bf16 bits in a uint16 container


@dataclass(frozen=True)
class CallChecks:
    """The facts a call is checked against: the layer's shape, capacity and device."""

    hidden: int
    num_topk: int
    capacity: int  # num_max_tokens_per_rank
    device: int

    def bound(self, num_tokens_bound: Any, t: int) -> int:
        """``num_tokens_bound`` checked against the call's ``t`` tokens (default: the capacity)."""
        if num_tokens_bound is None:
            return self.capacity
        bound = args.integer("num_tokens_bound", num_tokens_bound)
        if not t <= bound <= self.capacity:
            raise ValueError(
                f"num_tokens_bound={bound}: expected at least this call's {t} tokens and at most "
                f"the capacity num_max_tokens_per_rank={self.capacity}"
            )
        return max(bound, 1)

    def _output(self, out: Any, t: int, sh: int) -> tuple[Any, Any]:
        """The call's output (``out``, or a new array on the call's stream) and its checked view."""
        y = out
        if y is None:  # the device and stream contexts cost host time: only to allocate
            cupy = require_cupy()
            with cupy.cuda.Device(self.device), cupy_stream(cupy, sh):
                y = cupy.empty((t, self.hidden), dtype=cupy.uint16)
        ya = as_device_array(y, "out", stream=sh)
        check_array(ya, "out", dtypes=("bf16",), shape=(t, self.hidden), device=self.device)
        return y, ya

    def batch(self, x, x_sf, topk_idx, topk_weights, out, sh: int, num_tokens_bound) -> tuple[Call, Any]:
        """The checked call of ``MegaMoE.__call__`` and its output array."""
        passed = self._passing_batch(x, x_sf, topk_idx, topk_weights, out)
        if passed is not None:
            return passed._replace(bound=self.bound(num_tokens_bound, passed.num_tokens)), out
        return self._checked_batch(x, x_sf, topk_idx, topk_weights, out, sh, num_tokens_bound)

    def _checked_batch(self, x, x_sf, topk_idx, topk_weights, out, sh: int, num_tokens_bound) -> tuple[Call, Any]:
        """Every check, array by array, raising at the first that fails."""
        h, k, dev = self.hidden, self.num_topk, self.device
        xa = as_device_array(x, "x", stream=sh)
        check_array(xa, "x", dtypes=("e4m3",), ndim=2, device=dev)
        t = xa.shape[0]
        if xa.shape[1] != h:
            raise ValueError(f"x: expected shape [T, {h}], got {list(xa.shape)}")
        if t > self.capacity:
            raise ValueError(f"x: {t} tokens exceed the layer's capacity (num_max_tokens_per_rank={self.capacity})")
        bound = self.bound(num_tokens_bound, t)
        sfa = as_device_array(x_sf, "x_sf", stream=sh)
        check_array(sfa, "x_sf", dtypes=("float32",), shape=(t, h // 128), device=dev, align=4)
        ia = as_device_array(topk_idx, "topk_idx", stream=sh)
        idx = check_array(ia, "topk_idx", dtypes=("int32", "int64"), shape=(t, k), device=dev, align=ia.itemsize)
        wa = as_device_array(topk_weights, "topk_weights", stream=sh)
        check_array(wa, "topk_weights", dtypes=("float32",), shape=(t, k), device=dev, align=4)
        y, ya = self._output(out, t, sh)
        check_disjoint(ya, "out", {"x": xa, "x_sf": sfa, "topk_idx": ia, "topk_weights": wa})
        return Call(xa.ptr, sfa.ptr, ia.ptr, wa.ptr, ya.ptr, t, idx, bound), y

    def _passing_batch(self, x, x_sf, topk_idx, topk_weights, out) -> Call | None:
        """The call (its bound still to set) when every argument passes every check below, found
        without describing each array: what a decode loop hands in call after call (CuPy arrays,
        ``out`` given). None for anything else, and the full checks run and raise what is wrong.
        It passes nothing the full checks refuse (tests/cpu/test_layer_calls.py)."""
        h, k, dev = self.hidden, self.num_topk, self.device
        xs = plain_2d(x, _E4M3_TYPESTRS, dev)
        sfs = plain_2d(x_sf, _F32_TYPESTRS, dev)
        ids = plain_2d(topk_idx, _ID_TYPESTRS, dev)
        ws = plain_2d(topk_weights, _F32_TYPESTRS, dev)
        ys = plain_2d(out, _BF16_TYPESTRS, dev)
        if xs is None or sfs is None or ids is None or ws is None or ys is None:
            return None
        t = xs[1]
        if not 1 <= t <= self.capacity or xs[2] != h or ys[1:3] != (t, h):
            return None
        if sfs[1:3] != (t, h // 128) or ids[1:3] != (t, k) or ws[1:3] != (t, k):
            return None
        # The full checks' alignments: 16 bytes for the rows TMA and vector loads read, an element else.
        if xs[0] % 16 or ys[0] % 16 or sfs[0] % 4 or ws[0] % 4 or ids[0] % ids[3]:
            return None
        y_lo, y_hi = ys[0], ys[0] + t * h * 2
        for ptr, rows, cols, itemsize in (xs, sfs, ids, ws):
            if ptr < y_hi and y_lo < ptr + rows * cols * itemsize:
                return None  # the output over an input: the full checks name the pair
        return Call(xs[0], sfs[0], ids[0], ws[0], ys[0], t, "int64" if ids[3] == 8 else "int32", 0)

    def streamed(self, num_tokens: Any, out: Any, sh: int, num_tokens_bound: Any) -> tuple[Call, Any]:
        """The checked call of ``MegaMoE.consume`` (inputs come from the ring) and its output."""
        num_tokens = args.integer("num_tokens", num_tokens)
        if not 0 <= num_tokens <= self.capacity:
            raise ValueError(f"num_tokens={num_tokens}: expected 0..num_max_tokens_per_rank={self.capacity}")
        bound = self.bound(num_tokens_bound, num_tokens)
        y, ya = self._output(out, num_tokens, sh)
        return Call(0, 0, 0, 0, ya.ptr, num_tokens, "int32", bound), y
