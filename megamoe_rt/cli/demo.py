"""`megamoe-rt demo`: one MoE layer (a preset's EP8 per-rank slice) on random inputs,
checked against the NumPy reference on a sample of tokens, timed with CUDA events."""

from __future__ import annotations

import time

import numpy as np

from megamoe_rt import reference as ref
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset


def random_layer_inputs(cupy, tokens: int, hidden: int, intermediate: int, experts: int, topk: int, seed: int):
    """GPU-generated inputs: bf16-range activations quantized 1x128, a softmax/top-k router,
    weights ~ N(0, 1/fan_in) quantized 128x128."""
    from megamoe_rt.kernels.quantize import quantize_fp8, quantize_weight_fp8

    rs = cupy.random.RandomState(seed)
    x, x_sf = quantize_fp8(rs.standard_normal((tokens, hidden), dtype=cupy.float32))
    logits = rs.standard_normal((tokens, experts), dtype=cupy.float32)
    topk_idx = cupy.argsort(-logits, axis=1)[:, :topk].astype(cupy.int32)
    top = cupy.take_along_axis(logits, topk_idx, axis=1)
    w = cupy.exp(top - top.max(axis=1, keepdims=True))
    topk_weights = (w / w.sum(axis=1, keepdims=True)).astype(cupy.float32)
    w1, w1_sf = quantize_weight_fp8(
        rs.standard_normal((experts, 2 * intermediate, hidden), dtype=cupy.float32) / np.float32(np.sqrt(hidden))
    )
    w2, w2_sf = quantize_weight_fp8(
        rs.standard_normal((experts, hidden, intermediate), dtype=cupy.float32) / np.float32(np.sqrt(intermediate))
    )
    return dict(x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights, w1=w1, w1_sf=w1_sf, w2=w2, w2_sf=w2_sf)


def run_demo(
    preset_name: str, tokens: int, *, check_tokens: int = 64, device=None, seed: int = 0, mode: str | None = None
) -> dict:
    """Run, check and time the layer, printing as it goes; the result (``ok``: the check passed)."""
    import cupy

    from megamoe_rt.layer import MegaMoE

    p = get_preset(preset_name)
    experts = p.num_experts // DEFAULT_EP_RANKS
    layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, tokens, mode=mode)
    print(
        f"{device.name} ({device.sm_count} SMs): preset {p.name} EP{DEFAULT_EP_RANKS} slice: hidden {p.hidden}, "
        f"intermediate {p.intermediate}, {experts} experts, top-{p.num_topk}, {tokens} tokens, mode {layer.mode}"
    )
    inp = random_layer_inputs(cupy, tokens, p.hidden, p.intermediate, experts, p.num_topk, seed)
    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    args = (inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"])
    y = layer(*args)
    cupy.cuda.get_current_stream().synchronize()

    times = []
    for _ in range(10):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        layer(*args, out=y)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    ms = float(np.median(times))
    pairs = tokens * p.num_topk
    tflops = layer.flops(pairs) / (ms * 1e-3) / 1e12

    # Reference on a sample of tokens: each output row depends only on its own token.
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(tokens, size=min(check_tokens, tokens), replace=False))
    host = {k: cupy.asnumpy(v) for k, v in inp.items()}
    y_ref = ref.moe_forward(
        host["x"][sample].view(ref.E4M3),
        host["x_sf"][sample],
        host["topk_idx"][sample],
        host["topk_weights"][sample],
        host["w1"].view(ref.E4M3),
        host["w1_sf"],
        host["w2"].view(ref.E4M3),
        host["w2_sf"],
    )
    got = (cupy.asnumpy(y)[sample].astype(np.uint32) << 16).view(np.float32)
    diff = ref.calc_diff(got, y_ref.astype(np.float32))
    ok = diff < 1e-3 and np.isfinite(got).all()
    print(
        f"calc_diff vs reference ({len(sample)} tokens, {time.perf_counter() - t0:.1f} s on the CPU): {diff:.2e}"
        f"  {'OK' if ok else 'FAIL'}"
    )
    print(f"time {ms * 1e3:.1f} us (median of 10 calls, one stream, no graph)  {tflops:.1f} TFLOP/s")
    report = layer.memory_report().splitlines()
    print("\n".join(line for line in report if line.startswith(("total", "fused pools", "split pools", "split SMs"))))
    return {
        "device": device.name,
        "sm_count": device.sm_count,
        "preset": p.name,
        "hidden": p.hidden,
        "intermediate": p.intermediate,
        "experts": experts,
        "topk": p.num_topk,
        "tokens": tokens,
        "mode": layer.mode,
        "checked_tokens": len(sample),
        "calc_diff": float(diff),
        "ok": bool(ok),
        "median_us": ms * 1e3,
        "tflops": tflops,
        "buffer_bytes": layer.layout.total_bytes,
    }
