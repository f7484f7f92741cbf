"""Kernel time vs host overhead for one grouped-GEMM shape, per tile config."""

import time

import cupy as cp
import numpy as np

from megamoe_rt.kernels.gemm_heuristics import candidate_configs
from megamoe_rt.kernels.grouped_gemm import grouped_gemm_fp8, plan_grouped_gemm_fp8
from megamoe_rt.kernels.quantize import quantize_fp8

g, m, n, k = 32, 1536, 4096, 4096
rows = g * m
a, _ = quantize_fp8(cp.random.standard_normal((rows, k), dtype=cp.float32))
b, _ = quantize_fp8(cp.random.standard_normal((g * n, k), dtype=cp.float32))
b = b.reshape(g, n, k)
a_sf_t = cp.random.uniform(0.5, 1.5, size=(k // 128, rows)).astype(cp.float32)
b_sf = cp.full((g, n // 128, k // 128), 1 / 64, dtype=cp.float32)
offsets = cp.asarray(np.arange(g + 1, dtype=np.int32) * m)
out = cp.empty((rows, n), dtype=cp.uint16)
flops = 2.0 * rows * n * k
cfgs = [c for c in candidate_configs() if c.layout == "contiguous" and c.epilogue == "bf16" and c.a_sf_gran == 128]
for cfg in cfgs:

    def call(cfg=cfg):  # one-shot API: plan + run
        grouped_gemm_fp8(
            a, a_sf_t, b, b_sf, group_offsets=offsets, out=out, check_layout=False, a_sf_kmajor=True, config=cfg
        )

    call()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    call()
    host = time.perf_counter() - t0
    plan = plan_grouped_gemm_fp8(
        a, a_sf_t, b, b_sf, group_offsets=offsets, out=out, check_layout=False, a_sf_kmajor=True, config=cfg
    )
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    plan.run()
    host_run = time.perf_counter() - t0
    call = plan.run
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(10):
        call()
    e.record()
    e.synchronize()
    per = cp.cuda.get_elapsed_time(s, e) / 10
    print(
        f"{cfg.name:60s} host {host * 1e6:7.1f} us (plan.run {host_run * 1e6:5.1f})  kernel {per * 1e3:8.1f} us  {flops / per / 1e9:7.1f} TF/s",
        flush=True,
    )
