"""Host cost of a layer call's argument checks (``CallChecks.batch``: five arrays checked and
compared for overlap; these take its short path, as a decode loop's CuPy arrays do), on any
machine: the arrays are bare ``__cuda_array_interface__`` objects with the device named, so no
driver call is made. This
is the part of an eager call's host time that does not depend on the GPU (the rest, stream
queries and launches, is in ``megamoe-rt bench overhead``'s host column).

    python bench/host_checks_cost.py [--tokens 64] [--calls 20000]
"""

from __future__ import annotations

import argparse
import timeit
from types import SimpleNamespace

from megamoe_rt.layer_calls import CallChecks
from megamoe_rt.presets import get_preset


class _Array:
    """A CUDA array as a producer describes it: pointer, shape, type string, device 0. The
    interface is a property that builds its dictionary on every access, as CuPy's does."""

    def __init__(self, shape: tuple[int, ...], typestr: str, ptr: int) -> None:
        self.shape, self.typestr, self.ptr = shape, typestr, ptr
        self.device = SimpleNamespace(id=0)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False), "version": 3, "stream": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20000)
    a = parser.parse_args()
    p = get_preset("flash")
    t, h, k = a.tokens, p.hidden, p.num_topk
    arrays = [
        _Array((t, h), "|u1", 1 << 30),
        _Array((t, h // 128), "<f4", 2 << 30),
        _Array((t, k), "<i4", 3 << 30),
        _Array((t, k), "<f4", 4 << 30),
        _Array((t, h), "<u2", 5 << 30),
    ]
    checks = CallChecks(h, k, max(t, 1), 0)
    call = lambda: checks.batch(*arrays, 0, None)  # noqa: E731
    call()
    us = timeit.timeit(call, number=a.calls) / a.calls * 1e6
    print(f"CallChecks.batch, flash, {t} tokens: {us:.1f} us per call (out given)")


if __name__ == "__main__":
    main()
