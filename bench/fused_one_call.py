"""One small fused-mode layer call, for running under compute-sanitizer or cuda-gdb.

Usage: ``python bench/fused_one_call.py [MODE]`` (default ``fused``): hidden 512, intermediate
256, 8 experts, top-2, 128 tokens; prints ``ok`` and the output's checksum.
"""

import sys

import cupy as cp
import numpy as np

from megamoe_rt import MegaMoE
from megamoe_rt import reference as ref

h, i, e, k, t = 512, 256, 8, 2, 128
mode = sys.argv[1] if len(sys.argv) > 1 else "fused"
w = ref.random_moe_inputs(np.random.default_rng(1), t, h, i, e, k)
layer = MegaMoE(h, i, e, k, t, mode=mode)
layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
out = layer(
    cp.asarray(w["x"].view(np.uint8)), cp.asarray(w["x_sf"]), cp.asarray(w["topk_idx"]), cp.asarray(w["topk_weights"])
)
cp.cuda.Device().synchronize()
print("ok", float(cp.abs(cp.asarray(out).view(cp.uint16).astype(cp.float32)).sum()))
