"""``megamoe-rt launch``: a script run as N ranks, one process per GPU (megamoe_rt/ep/launch.py)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from megamoe_rt.cli.usage import UsageError, positive_int, positive_seconds


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    s = subparsers.add_parser("launch", help="run a script as N ranks, one process per GPU")
    s.add_argument("-n", "--nprocs", type=positive_int, required=True, help="number of ranks")
    s.add_argument("--timeout", type=positive_seconds, default=None, help="stop every rank after this many seconds")
    s.add_argument(
        "--devices",
        default=None,
        help="the ranks' GPUs, one ordinal per rank or one for all (e.g. 0: every rank on GPU 0, time-sharing it: "
        "for correctness checks on one GPU, not timings); default: rank r on GPU r",
    )
    s.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="SCRIPT is a module run as `python -m SCRIPT` (e.g. megamoe_rt.cli.bench)",
    )
    s.add_argument("script", help="Python script; it calls megamoe_rt.ep.launch.context_from_env()")
    s.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    from megamoe_rt.ep.launch import launch_script

    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"megamoe-rt launch: script {args.script!r} not found")
    try:
        return launch_script(
            args.nprocs, args.script, args.script_args, timeout=args.timeout, module=args.module, devices=args.devices
        )
    except ValueError as exc:  # --devices that do not fit -n
        raise UsageError(f"megamoe-rt launch: {exc}") from None
