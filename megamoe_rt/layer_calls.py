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
from megamoe_rt.runtime.arrays import as_device_array, check_array, check_disjoint, cupy_stream, require_cupy


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

    def streamed(self, num_tokens: Any, out: Any, sh: int, num_tokens_bound: Any) -> tuple[Call, Any]:
        """The checked call of ``MegaMoE.consume`` (inputs come from the ring) and its output."""
        num_tokens = args.integer("num_tokens", num_tokens)
        if not 0 <= num_tokens <= self.capacity:
            raise ValueError(f"num_tokens={num_tokens}: expected 0..num_max_tokens_per_rank={self.capacity}")
        bound = self.bound(num_tokens_bound, num_tokens)
        y, ya = self._output(out, num_tokens, sh)
        return Call(0, 0, 0, 0, ya.ptr, num_tokens, "int32", bound), y
