"""Where the host time of an eager layer call goes: ``calls`` back-to-back calls of one mode at one
preset slice under cProfile, then the functions that took the most time of their own.

    python bench/host_call_profile.py [--preset flash] [--tokens 64] [--mode fused,unfused,split]
                                      [--calls 200] [--top 25]

``bench overhead`` prints the host us per eager call; this says which lines make it up. The first
line of each mode is the host us per call without the profiler (the profiler's own cost inflates
every Python frame, so its totals read high; compare functions with each other).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--mode", default="fused,unfused,split")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    import cupy as cp

    from megamoe_rt import MegaMoE

    ((name, p, local, experts, t),) = preset_slices([a.preset], [a.tokens], 1)
    args, weights = rank_inputs(cp, 0, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
    stream = cp.cuda.Stream(non_blocking=True)
    for mode in a.mode.split(","):
        layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, mode=mode)
        layer.load_weights(*weights)
        y = cp.empty((t, p.hidden), dtype=cp.uint16)

        def calls(n: int, layer=layer, y=y) -> float:
            start = time.perf_counter()
            for _ in range(n):
                layer(*args, out=y, stream=stream)
            spent = time.perf_counter() - start
            stream.synchronize()
            return spent / n * 1e6

        calls(20)  # loads, schedules, first-call caches
        plain = min(calls(a.calls) for _ in range(3))
        profile = cProfile.Profile()
        profile.enable()
        calls(a.calls)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(a.top)
        print(f"== {name} T={t} {mode}: {plain:.1f} us of host time per eager call ({a.calls} calls)")
        print(out.getvalue())
        layer.synchronize()
        layer.close()


if __name__ == "__main__":
    main()
