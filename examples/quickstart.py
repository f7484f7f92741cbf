"""Quickstart: bf16 activations and a softmax/top-k router to the MoE output, with CuPy.

Run on a Hopper GPU:  python examples/quickstart.py
"""

import numpy as np

import megamoe_rt

# Before CuPy is imported: without the cu13 extra or a Hopper GPU, one line says what is missing.
megamoe_rt.require_gpu()

import cupy as cp

tokens, hidden, intermediate, experts, topk = 512, 2048, 1024, 16, 4

# Activations in bf16 (CuPy has no bf16 dtype: raw bits in uint16), quantized to e4m3 + 1x128 scales.
x_f32 = cp.random.standard_normal((tokens, hidden), dtype=cp.float32)
x_bf16 = (x_f32.view(cp.uint32) >> 16).astype(cp.uint16)
x, x_sf = megamoe_rt.quantize_fp8(x_bf16)

# Router: softmax over the top-k logits.
logits = cp.random.standard_normal((tokens, experts), dtype=cp.float32)
topk_idx = cp.argsort(-logits, axis=1)[:, :topk].astype(cp.int32)
top = cp.take_along_axis(logits, topk_idx, axis=1)
topk_weights = cp.exp(top - top.max(axis=1, keepdims=True))
topk_weights = (topk_weights / topk_weights.sum(axis=1, keepdims=True)).astype(cp.float32)

# Expert weights (gate rows then up rows in w1), quantized with 128x128 block scales.
w1, w1_sf = megamoe_rt.quantize_weight_fp8(
    cp.random.standard_normal((experts, 2 * intermediate, hidden), dtype=cp.float32) / np.float32(hidden**0.5)
)
w2, w2_sf = megamoe_rt.quantize_weight_fp8(
    cp.random.standard_normal((experts, hidden, intermediate), dtype=cp.float32) / np.float32(intermediate**0.5)
)

layer = megamoe_rt.MegaMoE(hidden, intermediate, experts, topk, num_max_tokens_per_rank=tokens)
layer.load_weights(w1, w1_sf, w2, w2_sf)
y_bits = layer(x, x_sf, topk_idx, topk_weights)  # bf16 bits, [tokens, hidden]
y = (y_bits.astype(cp.uint32) << 16).view(cp.float32)  # as float32 for inspection

print("y", y.shape, "mean |y|", float(cp.abs(y).mean()))
print(layer.memory_report())
