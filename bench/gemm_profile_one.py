"""One launch of the flash L1 8192 grouped GEMM, for Nsight Compute.

Usage: ``python bench/gemm_profile_one.py [MxN[c2]]``, a forced tile (default: the heuristic's;
``c2``: CTA pairs sharing the A tile).
"""

import sys

import cupy as cp
import numpy as np

from megamoe_rt.kernels.gemm_heuristics import tile_config
from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8
from megamoe_rt.kernels.quantize import quantize_fp8

config = None
if len(sys.argv) > 1:
    tile, paired = sys.argv[1].removesuffix("c2"), sys.argv[1].endswith("c2")
    bm, bn = (int(v) for v in tile.split("x"))
    config = tile_config(bm, bn, layout="contiguous", epilogue="bf16", cluster_n=2 if paired else 1)

g, m, n, k = 32, 1536, 4096, 4096
rows = g * m
a, _ = quantize_fp8(cp.random.standard_normal((rows, k), dtype=cp.float32))
b, _ = quantize_fp8(cp.random.standard_normal((g * n, k), dtype=cp.float32))
a_sf_t = cp.random.uniform(0.5, 1.5, size=(k // 128, rows)).astype(cp.float32)
b_sf = cp.full((g, n // 128, k // 128), 1 / 64, dtype=cp.float32)
offsets = cp.asarray(np.arange(g + 1, dtype=np.int32) * m)
plan = plan_grouped_gemm_fp8(
    a, a_sf_t, b.reshape(g, n, k), b_sf, group_offsets=offsets, check_layout=False, a_sf_kmajor=True, config=config
)
plan.run()
cp.cuda.Device().synchronize()
