"""Benchmarks of the grouped GEMM and of the layer on one GPU (timing: cli/timing.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megamoe_rt.cli.output import write_json
from megamoe_rt.cli.timing import HBM_BYTES_PER_S, DeviceTimer, bracketed, capture_layer_call
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset
from megamoe_rt.schedule.arith import align_up

# --- grouped GEMM -------------------------------------------------------------------------


@dataclass
class GemmShape:
    preset: str
    tokens: int
    stage: str  # "l1" or "l2"
    groups: int
    rows_per_group: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.rows_per_group * self.n * self.k


def gemm_shapes(presets: list[str], tokens: list[int], ranks: int = DEFAULT_EP_RANKS) -> list[GemmShape]:
    shapes = []
    for name in presets:
        p = get_preset(name)
        groups = p.num_experts // ranks
        for t in tokens:
            rows = t * ranks * p.num_topk // p.num_experts  # uniform routing, per local expert
            shapes.append(GemmShape(name, t, "l1", groups, rows, 2 * p.intermediate, p.hidden))
            shapes.append(GemmShape(name, t, "l2", groups, rows, p.hidden, p.intermediate))
    return shapes


def _forced_tile_arms(
    shape: GemmShape, tiles: Sequence[tuple[int, int, int]], plan_with: Callable[[Any], Any]
) -> dict[str, Callable[[], None]]:
    """One arm per tile asked for by ``--tiles`` (beside the heuristic's): the same operands
    through a plan built with that tile's configuration (its N must divide the shape's)."""
    from megamoe_rt.kernels.gemm_heuristics import tile_config

    arms: dict[str, Callable[[], None]] = {}
    for bm, bn, cluster in tiles:
        if shape.n % (bn * cluster):
            continue
        layout = "masked" if shape.stage == "decode" else "contiguous"
        cfg = tile_config(bm, bn, layout=layout, epilogue="bf16", cluster_n=cluster)
        arms[f"megamoe_rt {bm}x{bn}{'c2' if cluster == 2 else ''}"] = plan_with(cfg).run
    return arms


def _gemm_arms(
    shape: GemmShape, with_torch: bool, tiles: Sequence[tuple[int, int, int]] = ()
) -> tuple[dict[str, Callable[[], None]], str]:
    import cupy as cp
    import numpy as np

    from megamoe_rt.kernels.gemm_heuristics import choose_config
    from megamoe_rt.kernels.grouped_gemm import GROUP_ALIGN, plan_grouped_gemm_fp8
    from megamoe_rt.kernels.quantize import quantize_fp8
    from megamoe_rt.runtime import devices

    g, m, n, k = shape.groups, shape.rows_per_group, shape.n, shape.k
    if shape.stage == "decode":
        return _decode_arms(shape, tiles)
    padded = align_up(m, GROUP_ALIGN)
    rows = g * padded
    a, _ = quantize_fp8(cp.random.standard_normal((rows, k), dtype=cp.float32))
    b, _ = quantize_fp8(cp.random.standard_normal((g * n, k), dtype=cp.float32))
    b = b.reshape(g, n, k)
    rows_pad = align_up(rows, 4)
    a_sf_t = cp.random.uniform(0.5, 1.5, size=(k // 128, rows_pad)).astype(cp.float32)
    b_sf = (cp.random.uniform(0.5, 1.5, size=(g, n // 128, k // 128)) / np.sqrt(k)).astype(cp.float32)
    offsets = cp.asarray(np.arange(g + 1, dtype=np.int32) * padded)
    counts = cp.full((g,), m, dtype=cp.int32)
    out = cp.empty((rows, n), dtype=cp.uint16)
    info = devices.require_hopper()
    cfg = choose_config(
        layout="contiguous", epilogue="bf16", num_rows=rows, n=n, k=k, num_groups=g, sm_count=info.sm_count
    )

    def plan_with(config: Any = None) -> Any:
        return plan_grouped_gemm_fp8(
            a,
            a_sf_t,
            b,
            b_sf,
            group_offsets=offsets,
            group_counts=counts,
            out=out,
            check_layout=False,
            a_sf_kmajor=True,
            config=config,
        )

    arms: dict[str, Callable[[], None]] = {"megamoe_rt": plan_with().run}
    arms.update(_forced_tile_arms(shape, tiles, plan_with))
    if with_torch:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            ta = torch.from_dlpack(a.reshape(rows, k)).view(torch.float8_e4m3fn)
            tb = torch.from_dlpack(b).view(torch.float8_e4m3fn)
            ends = torch.arange(1, g + 1, dtype=torch.int32, device="cuda") * padded
            sa = torch.ones(rows, dtype=torch.float32, device="cuda")
            sb = torch.ones(g, n, dtype=torch.float32, device="cuda")

            def scaled_grouped():
                torch._scaled_grouped_mm(ta, tb.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16)

            arms["torch._scaled_grouped_mm"] = scaled_grouped
            # Dense FP8 with the same FLOPs (the ceiling arm): [g*m, k] x [k, n].
            dm = max(16, g * m // 16 * 16)
            da = ta[:dm]
            db = tb.reshape(g * n, k)[:n]
            one = torch.ones((), dtype=torch.float32, device="cuda")

            def scaled_dense():
                torch._scaled_mm(da, db.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            arms["torch._scaled_mm (dense)"] = scaled_dense
    return arms, cfg.name


def _decode_arms(
    shape: GemmShape, tiles: Sequence[tuple[int, int, int]] = ()
) -> tuple[dict[str, Callable[[], None]], str]:
    """Masked layout, every group full: the decode-sized L1 call, bound by reading the weights."""
    import cupy as cp

    from megamoe_rt.kernels.gemm_heuristics import choose_config
    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8
    from megamoe_rt.kernels.quantize import quantize_fp8
    from megamoe_rt.runtime import devices

    g, m, n, k = shape.groups, shape.rows_per_group, shape.n, shape.k
    a, a_sf = quantize_fp8(cp.random.standard_normal((g * m, k), dtype=cp.float32))
    b, _ = quantize_fp8(cp.random.standard_normal((g * n, k), dtype=cp.float32))
    b_sf = cp.full((g, n // 128, k // 128), 1.0 / 64, dtype=cp.float32)
    a_sf_t = cp.ascontiguousarray(a_sf.T)
    counts = cp.full((g,), m, dtype=cp.int32)
    out = cp.empty((g, m, n), dtype=cp.uint16)
    a3, b3 = a.reshape(g, m, k), b.reshape(g, n, k)
    cfg = choose_config(
        layout="masked",
        epilogue="bf16",
        num_rows=g * m,
        n=n,
        k=k,
        num_groups=g,
        sm_count=devices.require_hopper().sm_count,
        masked_rows=m,
    )

    def plan_with(config: Any = None) -> Any:
        return plan_grouped_gemm_fp8(
            a3, a_sf_t, b3, b_sf, masked_counts=counts, out=out, check_layout=False, a_sf_kmajor=True, config=config
        )

    return {"megamoe_rt": plan_with().run, **_forced_tile_arms(shape, tiles, plan_with)}, cfg.name


def decode_shapes(presets: list[str], ranks: int = DEFAULT_EP_RANKS) -> list[GemmShape]:
    out = []
    for name in presets:
        p = get_preset(name)
        out.append(GemmShape(name, 64, "decode", p.num_experts // ranks, 64, 2 * p.intermediate, p.hidden))
    return out


def bench_gemm(
    presets: list[str],
    tokens: list[int],
    *,
    with_torch: bool = True,
    rounds: int = 3,
    json_path: str | None = None,
    tiles: Sequence[tuple[int, int, int]] = (),
) -> list[dict]:
    """The grouped GEMM against its peers; ``tiles`` adds an arm per forced tile shape (the
    heuristic's choice is always the ``megamoe_rt`` arm)."""
    timer = DeviceTimer()
    rows = []
    for shape in gemm_shapes(presets, tokens) + decode_shapes(presets):
        arms, cfg_name = _gemm_arms(shape, with_torch, tiles)
        results = bracketed(timer, arms, rounds=rounds)
        row: dict[str, Any] = {"shape": asdict(shape), "config": cfg_name, "flops": shape.flops, "arms": {}}
        if shape.stage == "decode":
            row["weight_bytes"] = shape.groups * shape.n * shape.k
            row["weight_read_floor_us"] = row["weight_bytes"] / HBM_BYTES_PER_S * 1e6
        for name, r in results.items():
            dense_flops = (
                shape.flops
                if "dense" not in name
                else 2.0 * max(16, shape.groups * shape.rows_per_group // 16 * 16) * shape.n * shape.k
            )
            tflops = dense_flops / (r.median_us * 1e-6) / 1e12 if r.error is None else None
            row["arms"][name] = {
                "median_us": r.median_us,
                "band_us": list(r.band_us),
                "rounds_us": r.rounds_us,
                "tflops": tflops,
                "error": r.error,
            }
        rows.append(row)
        _print_gemm_row(row)
    if json_path:
        write_json(json_path, rows)
    return rows


def _print_gemm_row(row: dict) -> None:
    s = row["shape"]
    label = f"{s['preset']:>5} {s['stage']} T={s['tokens']:<5} {s['groups']}x{s['rows_per_group']:<5} N={s['n']:<5} K={s['k']:<5}"
    parts = []
    for name, a in row["arms"].items():
        if a["error"]:
            parts.append(f"{name}: n/a")
        else:
            parts.append(f"{name}: {a['median_us']:8.1f} us {a['tflops']:7.1f} TF/s")
    ours = row["arms"]["megamoe_rt"].get("tflops")
    peer = row["arms"].get("torch._scaled_grouped_mm", {}).get("tflops")
    ratio = f"  ratio {ours / peer:5.2f}" if ours and peer else ""
    if "weight_read_floor_us" in row and not row["arms"]["megamoe_rt"]["error"]:
        ratio += f"  x{row['arms']['megamoe_rt']['median_us'] / row['weight_read_floor_us']:.2f} of weight-read floor"
    print(f"{label} | " + " | ".join(parts) + ratio, flush=True)


# --- whole layer --------------------------------------------------------------------------


def fused_trace(layer, args, stream, **kwargs) -> dict[str, tuple[float, float, float]]:
    """One traced fused call: per event of ``kernels.fused.TRACE_EVENTS``, the (min, median,
    max) over blocks of its time in µs from the first block's start."""
    import cupy as cp
    import numpy as np

    from megamoe_rt.kernels.fused import TRACE_TIMES
    from megamoe_rt.testing import trace_buffer

    with trace_buffer(layer) as trace, stream:
        layer(*args, stream=stream, **kwargs)
        stream.synchronize()
    stamps = cp.asnumpy(trace).astype(np.int64)[:, : len(TRACE_TIMES)]
    rel = (stamps - stamps[:, 0].min()) / 1e3
    return {
        e: (float(rel[:, j].min()), float(np.median(rel[:, j])), float(rel[:, j].max()))
        for j, e in enumerate(TRACE_TIMES)
    }


def print_fused_trace(title: str, events: dict[str, tuple[float, float, float]]) -> None:
    print(f"{title}, µs from the first block's start:")
    for event, (lo, mid, hi) in events.items():
        print(f"  {event:>15}: min {lo:8.1f}  median {mid:8.1f}  max {hi:8.1f}")


def bench_moe(
    presets: list[str],
    tokens: list[int],
    *,
    mode: str | list[str] | None = None,
    rounds: int = 3,
    capacity: int | None = None,
    json_path: str | None = None,
) -> list[dict]:
    """The layer (a preset's EP8 per-rank slice on one GPU) captured in a CUDA graph and
    replayed: device time, useful TFLOP/s, HBM GB/s of the compulsory traffic, buffer MiB.

    ``mode``: one mode or several, bracketed in rounds against each other (megamoe_rt/cli/timing.py);
    default the baseline mode (megamoe_rt.modes.registry.baseline_mode).
    ``capacity``: the buffers' token capacity, at least every row's tokens (default: each
    row's token count); the fused arm passes ``num_tokens_bound`` = the row's tokens, as a
    caller with uniform ranks would.
    """
    import cupy as cp

    from megamoe_rt.cli.demo import random_layer_inputs
    from megamoe_rt.layer import MODES, MegaMoE
    from megamoe_rt.modes.registry import baseline_mode

    modes = [baseline_mode()] if mode is None else [mode] if isinstance(mode, str) else list(mode)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode: {m!r} is not one of {MODES}")
    if capacity is not None:
        from megamoe_rt.runtime import args as checks

        checks.integer("capacity", capacity, minimum=max(tokens, default=1))  # at least the largest token count
    timer = DeviceTimer()
    rows = []
    for name in presets:
        p = get_preset(name)
        experts = p.num_experts // DEFAULT_EP_RANKS
        for t in tokens:
            cap = capacity or t
            inp = random_layer_inputs(cp, t, p.hidden, p.intermediate, experts, p.num_topk, seed=t)
            args = (inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"])
            stream = cp.cuda.Stream(non_blocking=True)
            layers, graphs = {}, {}
            arms: dict[str, Callable[[], None]] = {}
            for m in modes:
                layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, cap, mode=m)
                layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"], stream=stream)
                y = cp.empty((t, p.hidden), dtype=cp.uint16)
                graphs[m] = capture_layer_call(layer, args, y, stream, num_tokens_bound=t)
                layers[m] = layer
                arms[m] = functools.partial(graphs[m].launch, stream=stream)
            with stream:
                results = bracketed(timer, arms, rounds=rounds)
            pairs = t * p.num_topk
            active = len(set(cp.asnumpy(inp["topk_idx"]).ravel().tolist()))
            weight_bytes = active * (2 * p.intermediate * p.hidden + p.hidden * p.intermediate)
            act_bytes = t * p.hidden * 2 + pairs * (p.hidden + p.intermediate) * 2 + pairs * p.hidden * 2 * 2
            base = results[modes[0]].median_us
            for m in modes:
                res = results[m]
                layer = layers[m]
                row: dict[str, Any] = {
                    "preset": name,
                    "tokens": t,
                    "capacity": cap,
                    "mode": m,
                    "experts": experts,
                    "topk": p.num_topk,
                    "median_us": res.median_us,
                    "band_us": list(res.band_us),
                    "rounds_us": res.rounds_us,
                    "tflops": layer.flops(pairs) / (res.median_us * 1e-6) / 1e12,
                    "hbm_gbps": (weight_bytes + act_bytes) / (res.median_us * 1e-6) / 1e9,
                    "buffer_mib": layer.layout.total_bytes / 2**20,
                    f"ratio_vs_{modes[0]}": res.median_us / base,
                }
                rows.append(row)
                print(
                    f"{name:>5} T={t:<5} {m:>8}: {row['median_us']:9.1f} us ({row['band_us'][0]:.1f}-"
                    f"{row['band_us'][1]:.1f})  {row['tflops']:7.1f} TFLOP/s  {row['hbm_gbps']:7.0f} GB/s  "
                    f"buffer {row['buffer_mib']:8.1f} MiB  x{row[f'ratio_vs_{modes[0]}']:.3f}",
                    flush=True,
                )
            del layers, graphs, arms, inp
            cp.get_default_memory_pool().free_all_blocks()
    if json_path:
        write_json(json_path, rows)
    return rows
