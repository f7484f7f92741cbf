"""``megamoe-rt sweep``: a pipeline spec's graph, run once or across SM splits of one partition (GPU)."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli import commands
from megamoe_rt.cli.output import add_output_options, check_output, check_writable, emit, progress_to_stderr
from megamoe_rt.cli.usage import UsageError, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    s = subparsers.add_parser("sweep", help="run a pipeline spec's graph, once or across SM splits of one partition")
    s.add_argument(
        "--spec",
        required=True,
        help="a spec file, or the name of one the package ships (graphs/: e.g. membound_vs_gemm)",
    )
    s.add_argument(
        "--vary",
        default=None,
        help="PARTITION=START..STOP[:STEP], e.g. left=8..120:8 (default: run the spec once as written)",
    )
    s.add_argument("--reps", type=positive_int, default=10, help="timed replays per point (median)")
    add_output_options(s, "the rows")
    s.add_argument("--plot", default=None, metavar="FILE", help="write a PNG plot (needs matplotlib and --vary)")
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    from megamoe_rt.graph import SpecError, load_spec
    from megamoe_rt.graph.spec import resolve_spec
    from megamoe_rt.graph.sweep import format_table, parse_vary, run_sweep, sweep_points
    from megamoe_rt.graph.workloads import KNOWN

    # Without --vary the spec runs once with its own partition sizes.
    if args.vary is None and args.plot:
        raise UsageError("megamoe-rt sweep: --plot needs --vary (a single run has no curve to plot)")
    check_output("megamoe-rt sweep", args)
    check_writable("megamoe-rt sweep", "--plot", args.plot)
    try:
        path = resolve_spec(args.spec)  # a file, or the name of a shipped spec
    except SpecError as exc:
        raise UsageError(f"megamoe-rt sweep: --spec {exc}") from None
    try:
        name, values = parse_vary(args.vary) if args.vary is not None else (None, None)
        spec = load_spec(path, known_kernels=KNOWN)
        sweep_points(spec, name, values)  # the varied partition must exist: checked before any GPU work
    except (ValueError, OSError) as exc:
        raise UsageError(f"megamoe-rt sweep: {exc}") from None
    if args.plot is not None:
        from megamoe_rt.cli.plotting import plotting_or_report

        if not plotting_or_report("megamoe-rt sweep", "--plot"):  # before the GPU work, not after it
            return 1
    info = commands.hopper_or_none("sweep")
    if info is None:
        return 1
    with progress_to_stderr(args):
        try:
            rows = run_sweep(spec, name, values, device=info.ordinal, reps=args.reps)
        except SpecError as exc:
            raise UsageError(f"megamoe-rt sweep: {exc}") from None
        what = "partitions as specified" if name is None else f"varying {name}"
        print(f"spec {spec.name} on {info.name} ({info.sm_count} SMs), {what}")
        print(format_table(rows, name))
        if args.plot:
            from megamoe_rt.cli.plotting import sweep_chart

            sweep_chart(rows, name, args.plot)
    emit(args, {"spec": spec.name, "vary": name, "device": info.name, "rows": rows})
    return 0
