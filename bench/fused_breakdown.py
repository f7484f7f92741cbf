"""Where a fused call's time goes: arms bracketed against the unfused layer, then the
per-block event trace of one fused call (fused.TRACE_EVENTS, µs from the first block's start).

    python bench/fused_breakdown.py flash 8192

Arms: unfused; unfused with both GEMMs on the fused kernel's 64x256 tile; fused; fused with a
ring as large as the worst-case pool (which makes the call single-wave).
"""

from __future__ import annotations

import sys

import cupy as cp

import megamoe_rt.kernels.grouped_gemm as gemm
from megamoe_rt import MegaMoE
from megamoe_rt.cli.benchmarks import fused_trace, print_fused_trace
from megamoe_rt.cli.demo import random_layer_inputs
from megamoe_rt.cli.timing import DeviceTimer, bracketed, capture_layer_call
from megamoe_rt.kernels.gemm_heuristics import _config
from megamoe_rt.presets import get_preset
from megamoe_rt.testing import fused_schedule_of


def main(preset: str, tokens: int) -> None:
    p = get_preset(preset)
    experts = p.num_experts // 8
    inp = random_layer_inputs(cp, tokens, p.hidden, p.intermediate, experts, p.num_topk, seed=tokens)
    args = (inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"])
    stream = cp.cuda.Stream(non_blocking=True)
    arms, layers = {}, {}

    def add(name, **kw):
        layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, tokens, **kw)
        layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
        y = cp.empty((tokens, p.hidden), cp.uint16)
        graph = capture_layer_call(layer, args, y, stream)
        arms[name] = lambda g=graph: g.launch(stream=stream)
        layers[name] = layer

    add("unfused", mode="unfused")
    heuristic = gemm.choose_config

    def on_64x256(**kw):
        # The fused kernel's tiles: L1 with its SwiGLU epilogue (64-column B scales), L2 scattering.
        swiglu = kw["epilogue"] == "swiglu_fp8"
        return _config(
            64,
            256,
            a_sf_gran=kw.get("a_sf_gran", 128),
            b_sf_n=64 if swiglu else 128,
            out_sf_gran=kw.get("out_sf_gran", 128) if swiglu else 128,
            layout=kw["layout"],
            epilogue=kw["epilogue"],
        )

    gemm.choose_config = on_64x256
    add("unfused_on_64x256", mode="unfused")
    gemm.choose_config = heuristic
    add("fused", mode="fused")
    add("fused_full_pool", mode="fused", ring_blocks=fused_schedule_of(layers["fused"]).full_pool_blocks)
    with stream:
        results = bracketed(DeviceTimer(), arms, rounds=1)
    pairs = tokens * p.num_topk
    for name, r in results.items():
        print(
            f"{preset} T={tokens} {name:>18}: {r.median_us:8.1f} us  "
            f"{layers[name].flops(pairs) / r.median_us / 1e6:7.1f} TFLOP/s"
        )

    layer = layers["fused"]
    print_fused_trace(f"fused trace ({fused_schedule_of(layer)})", fused_trace(layer, args, stream))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
