"""The fault suite: inject each fault the runtime must survive, record what happens.

``python -m megamoe_rt.cli.faults [--json] [-o F] [--md F]``. Every fault runs in a fresh process (a
trap ends the CUDA context of the process it happens in) under a wall-clock limit, so a hang
shows as a hang. Per fault: the outcome (the error raised, or what the runtime did instead),
the time from the faulty step to the error, and whether later calls in the same process work.
Faults that need two GPUs are reported as not run on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass

from megamoe_rt.cli.output import (
    add_output_options,
    check_output,
    check_writable,
    emit,
    progress_to_stderr,
)
from megamoe_rt.cli.usage import Parser, UsageError, positive_seconds, report

# What each scenario's script shares: a small layer and its inputs.
_PRELUDE = """
import json, sys, time
import numpy as np
import cupy as cp
from megamoe_rt import MegaMoE, DeviceInputError, reference as ref, testing
H, I, E, K, T = 512, 256, 8, 2, 64
rng = np.random.default_rng(1)
inp = ref.random_moe_inputs(rng, T, H, I, E, K)
def layer_of(**kw):
    layer = MegaMoE(H, I, E, K, T, **kw)
    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    return layer
def args_of(idx=None):
    return (cp.asarray(inp["x"].view(np.uint8)), cp.asarray(inp["x_sf"]),
            cp.asarray(inp["topk_idx"] if idx is None else idx), cp.asarray(inp["topk_weights"]))
def good_call_ok(layer):
    y = layer(*args_of())
    layer.synchronize()
    got = (cp.asnumpy(y).astype(np.uint32) << 16).view(np.float32)
    exp = ref.moe_forward(inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"],
                          inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    return bool(ref.calc_diff(got, exp.astype(np.float32)) < 1e-3)
def report(outcome, detect_s, later):
    print("FAULT-RESULT " + json.dumps({"outcome": outcome, "detect_s": detect_s, "later": later}))
def first_line(exc):
    text = " ".join(line.strip() for line in str(exc).splitlines())
    return f"{type(exc).__name__}: {text[:220]}"
"""

# name -> (what is injected, script body); the body calls report(...) once.
_SCENARIOS: dict[str, tuple[str, str]] = {
    "bad_ids": (
        "an expert id outside [-1, E) in one call",
        """
        layer = layer_of()
        idx = inp["topk_idx"].copy(); idx[3, 1] = E + 5
        layer(*args_of(idx))
        t0 = time.monotonic()
        try:
            layer.synchronize(); report("no error", None, None)
        except DeviceInputError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "repeated_ids": (
        "one expert twice in a token's top-k",
        """
        layer = layer_of()
        idx = inp["topk_idx"].copy(); idx[5, 1] = idx[5, 0]
        layer(*args_of(idx))
        cp.cuda.Device().synchronize()
        t0 = time.monotonic()
        try:
            layer(*args_of()); report("no error", None, None)
        except DeviceInputError as exc:  # raised by the next call, which launches nothing
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "bad_group_offsets": (
        "grouped GEMM group_offsets not multiples of the tile height",
        """
        from megamoe_rt import grouped_gemm_fp8, quantize_fp8, quantize_weight_fp8
        a, a_sf = quantize_fp8(cp.random.standard_normal((384, 256), dtype=cp.float32))
        b, b_sf = quantize_weight_fp8(cp.random.standard_normal((2, 256, 256), dtype=cp.float32))
        t0 = time.monotonic()
        try:
            grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=cp.asarray(np.array([0, 100, 256], np.int32)))
            report("no error", None, None)
        except ValueError as exc:
            detect = time.monotonic() - t0
            grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=cp.asarray(np.array([0, 128, 256], np.int32)))
            cp.cuda.Device().synchronize()
            report(first_line(exc), detect, "yes")
        """,
    ),
    "withheld_signal": (
        "fused: one block never publishes its rows (timeout_s=0.5)",
        """
        from megamoe_rt.runtime import driver
        from cuda.bindings import driver as cu
        layer = layer_of(mode="fused", timeout_s=0.5)
        t0 = time.monotonic()
        with testing.withhold_block(layer, 0):
            layer(*args_of())
        try:
            driver.call(cu.cuCtxSynchronize); report("no error", None, None)
        except driver.CudaError as exc:
            report(first_line(exc), time.monotonic() - t0, "no: the trap ends the CUDA context; restart the process")
        """,
    ),
    "single_wave_past_ring": (
        "fused: a single-wave order larger than the ring (what a bound below a peer's count does)",
        """
        from megamoe_rt.runtime import driver
        from megamoe_rt.modes.fused import CallSchedule
        from cuda.bindings import driver as cu
        H, I, E, K, T = 512, 256, 16, 6, 2048
        inp = ref.random_moe_inputs(rng, T, H, I, E, K)
        layer = layer_of(mode="fused", timeout_s=1.0)
        full = testing.fused_schedule_of(layer).full_pool_blocks
        t0 = time.monotonic()
        with testing.force_call_schedule(layer, CallSchedule(True, full, 4)):
            layer(*args_of())
        try:
            driver.call(cu.cuCtxSynchronize); report("no error", None, None)
        except driver.CudaError as exc:
            report(first_line(exc), time.monotonic() - t0, "no: the trap ends the CUDA context; restart the process")
        """,
    ),
    "ring_too_small": (
        "fused: ring_blocks below the schedule's live window",
        """
        t0 = time.monotonic()
        try:
            layer_of(mode="fused", ring_blocks=2); report("no error", None, None)
        except ValueError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer_of(mode="fused")) else "no")
        """,
    ),
    "bound_below_tokens": (
        "num_tokens_bound below the call's token count",
        """
        layer = layer_of()
        t0 = time.monotonic()
        try:
            layer(*args_of(), num_tokens_bound=T // 2); report("no error", None, None)
        except ValueError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "timeout_zero": (
        "timeout_s=0",
        """
        t0 = time.monotonic()
        try:
            layer_of(timeout_s=0); report("no error", None, None)
        except ValueError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer_of()) else "no")
        """,
    ),
    "timeout_huge": (
        "timeout_s=1e30 (clamped to 2^58 ns)",
        """
        layer = layer_of(timeout_s=1e30)
        report("accepted, clamped; calls run", None, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "weights_reloaded_under_graph": (
        "load_weights again after a call was captured in a CUDA graph",
        """
        layer = layer_of()
        a = args_of(); y = cp.empty((T, H), cp.uint16)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            layer(*a, out=y, stream=s); s.synchronize()
            s.begin_capture(); layer(*a, out=y, stream=s); g = s.end_capture()
            w = ref.random_moe_inputs(np.random.default_rng(9), 1, H, I, E, K)
            layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"], stream=s)
            g.launch(stream=s); s.synchronize()
        got = (cp.asnumpy(y).astype(np.uint32) << 16).view(np.float32)
        exp = ref.moe_forward(inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"],
                              w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
        ok = ref.calc_diff(got, exp.astype(np.float32)) < 1e-3
        report("the replay computes with the new weights" if ok else "WRONG: the replay used stale weights", None,
               "yes" if ok else "no")
        """,
    ),
    "planted_cache_entry": (
        "a cubin cache entry overwritten with garbage",
        """
        import os
        from megamoe_rt.jit import compile_kernel
        from megamoe_rt.jit.cache import CubinCache
        from megamoe_rt.kernels import moe as mk
        spec = mk.combine_spec("int32")
        first = compile_kernel(spec)
        cache = CubinCache()
        path = cache.path_for(first.cache_key)
        with open(path, "r+b") as f:
            f.seek(64); f.write(os.urandom(256))
        t0 = time.monotonic()
        again = compile_kernel(spec)
        outcome = "entry refused and rebuilt" if not again.from_cache else "WRONG: the damaged entry was loaded"
        report(outcome, time.monotonic() - t0, "yes" if good_call_ok(layer_of(mode="unfused")) else "no")
        """,
    ),
    "bad_input_one_rank": (
        "EP2: one rank passes x_sf of the wrong shape",
        """
        from megamoe_rt.ep.launch import spawn, RankFailed
        from megamoe_rt.cli import faults
        if cp.cuda.runtime.getDeviceCount() < 2:
            report("not run: needs 2 GPUs", None, None); sys.exit(0)
        t0 = time.monotonic()
        out = spawn(faults.bad_input_rank, 2, timeout=300)
        same = len({m for m, _ in out}) == 1
        report(("every rank: " if same else "RANKS DIFFER: ") + out[0][0], time.monotonic() - t0,
               "yes" if all(ok for _, ok in out) else "no")
        """,
    ),
    "rank_killed_mid_call": (
        "EP2: a rank's process exits right after launching a call (timeout_s=2)",
        """
        from megamoe_rt.ep.launch import spawn, RankFailed
        from megamoe_rt.cli import faults
        if cp.cuda.runtime.getDeviceCount() < 2:
            report("not run: needs 2 GPUs", None, None); sys.exit(0)
        t0 = time.monotonic()
        try:
            spawn(faults.killed_rank, 2, timeout=300); report("no error", None, None)
        except RankFailed as exc:
            report(first_line(exc), time.monotonic() - t0, "no: the launch is over; restart it")
        """,
    ),
}


def _ep_layer(ctx):
    import cupy as cp
    import numpy as np

    from megamoe_rt import MegaMoE
    from megamoe_rt import reference as ref

    cp.cuda.Device(ctx.device).use()
    h, i, e, k, t = 512, 256, 16, 2, 64
    w = ref.random_moe_inputs(np.random.default_rng(3), 1, h, i, e, k)
    inp = ref.random_moe_inputs(np.random.default_rng(10 + ctx.rank), t, h, i, e, k)
    layer = MegaMoE(h, i, e, k, t, group=ctx, timeout_s=2.0)
    el = e // ctx.world_size
    own = slice(ctx.rank * el, (ctx.rank + 1) * el)
    layer.load_weights(w["w1"][own], w["w1_sf"][own], w["w2"][own], w["w2_sf"][own])
    args = [
        cp.asarray(inp["x"].view(np.uint8)),
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
    ]
    return layer, args


def bad_input_rank(ctx):
    """Rank 1's x_sf has the wrong shape: every rank must raise the same error, and a good
    call afterwards must run on every rank."""
    layer, args = _ep_layer(ctx)
    bad = list(args)
    if ctx.rank == 1:
        bad[1] = bad[1][:, :1].copy()
    message = "no error"
    try:
        layer(*bad)
    except ValueError as exc:
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    layer(*args)
    layer.synchronize()
    return message, True


def killed_rank(ctx):
    import os

    layer, args = _ep_layer(ctx)
    layer(*args)
    if ctx.rank == 1:
        os._exit(9)  # gone with its call in flight
    layer.synchronize()
    return "finished"


@dataclass
class FaultRow:
    fault: str
    injected: str
    outcome: str
    detect_s: float | None
    later_calls: str | None
    wall_s: float
    hang: bool


def run_fault(name: str, limit_s: float) -> FaultRow:
    injected, body = _SCENARIOS[name]
    script = _PRELUDE + textwrap.dedent(body)
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return FaultRow(name, injected, f"HANG: no result within {limit_s:g} s", None, None, limit_s, True)
    wall = time.monotonic() - start
    for line in out.stdout.splitlines():
        if line.startswith("FAULT-RESULT "):
            r = json.loads(line[len("FAULT-RESULT ") :])
            return FaultRow(name, injected, r["outcome"], r["detect_s"], r["later"], wall, False)
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return FaultRow(
        name, injected, f"process exited {out.returncode} without a result: {tail}", None, None, wall, False
    )


def markdown(rows: list[FaultRow]) -> str:
    lines = [
        "| fault | injected | outcome | detected after | later calls work | hang |",
        "|---|---|---|---:|---|---|",
    ]
    for r in rows:
        detect = "-" if r.detect_s is None else f"{r.detect_s:.3f} s"
        lines.append(
            f"| {r.fault} | {r.injected} | {r.outcome.replace('|', '/')} | {detect} | {r.later_calls or '-'} | "
            f"{'yes' if r.hang else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options and the faults to run; a bad option, an unknown fault or a file that cannot
    be written: one line on stderr and SystemExit(2)."""
    ap = Parser(prog="python -m megamoe_rt.cli.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated fault names (default: all)")
    ap.add_argument("--limit", type=positive_seconds, default=240.0, help="seconds before a fault counts as a hang")
    add_output_options(ap, "the rows")
    ap.add_argument("--md", default=None, metavar="FILE", help="write the table as Markdown to FILE")
    try:
        a = ap.parse_args(argv)
        names = list(_SCENARIOS) if a.only is None else [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in _SCENARIOS]
        if unknown:
            raise UsageError(f"{ap.prog}: unknown fault {unknown[0]!r}; known: {', '.join(_SCENARIOS)}")
        check_output(ap.prog, a)
        check_writable(ap.prog, "--md", a.md)
    except UsageError as exc:
        raise SystemExit(report(exc)) from None
    return a, names


def main(argv: list[str] | None = None) -> int:
    a, names = _arguments(argv)  # bad arguments: one line, SystemExit(2), before the GPU check
    from megamoe_rt.requirements import gpu_or_report

    # Every fault needs the GPU: without one each would run (seconds apiece) only to fail alike.
    if gpu_or_report("python -m megamoe_rt.cli.faults") is None:
        return 1
    rows = []
    with progress_to_stderr(a):
        for name in names:
            row = run_fault(name, a.limit)
            print(f"{row.fault:>28}: {row.outcome} ({row.wall_s:.1f} s)", flush=True)
            rows.append(row)
    emit(a, [asdict(r) for r in rows])
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(rows))
    return 0 if not any(r.hang or r.outcome.startswith(("WRONG", "no error")) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
