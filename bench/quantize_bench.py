"""Time the FP8 quantizer against the HBM ceiling (CUDA events, L2 flushed, median of 20)."""

from __future__ import annotations

import json
import sys

import cupy as cp
import numpy as np

import megamoe_rt

HBM_TBPS = 4.3  # measured device-to-device copy, read + write, on the lent H200


def time_ms(fn, flush, reps=20):
    times = []
    for _ in range(reps):
        flush()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(times)), float(min(times)), float(max(times))


def main():
    scratch = cp.empty(512 * 2**20, dtype=cp.uint8)  # > 60 MB L2: a write evicts it

    def flush():
        scratch.fill(1)

    rows = []
    for t, h, dt in [(8192, 4096, "bf16"), (8192, 7168, "bf16"), (8192, 7168, "float32"), (65536, 7168, "bf16")]:
        x = cp.random.standard_normal((t, h), dtype=cp.float32)
        if dt == "bf16":
            x = (x.view(cp.uint32) >> 16).astype(cp.uint16)
        q, sf = megamoe_rt.quantize_fp8(x)
        med, lo, hi = time_ms(lambda: megamoe_rt.quantize_fp8(x, out=q, out_sf=sf), flush)  # noqa: B023 (timed here, in this iteration)
        nbytes = x.nbytes + q.nbytes + sf.nbytes
        rows.append(
            {
                "tokens": t,
                "hidden": h,
                "input": dt,
                "median_us": med * 1e3,
                "min_us": lo * 1e3,
                "max_us": hi * 1e3,
                "bytes": nbytes,
                "GBps": nbytes / med / 1e6,
                "hbm_fraction": nbytes / med / 1e6 / (HBM_TBPS * 1e3),
            }
        )
    json.dump(rows, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=2)  # noqa: SIM115 (closed at exit)
    print()
    print(f"{'T':>6} {'H':>5} {'in':>7} {'median us':>10} {'GB/s':>7} {'of HBM':>7}")
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['hidden']:>5} {r['input']:>7} {r['median_us']:>10.1f} {r['GBps']:>7.0f} {r['hbm_fraction']:>7.0%}"
        )


if __name__ == "__main__":
    main()
