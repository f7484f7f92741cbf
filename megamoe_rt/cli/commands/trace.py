"""``megamoe-rt trace``: one call's per-block stage trace as a Chrome/Perfetto trace file (GPU);
the trace itself is megamoe_rt/cli/trace.py."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli import commands


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from megamoe_rt.cli.trace import add_arguments

    s = subparsers.add_parser(
        "trace",
        help="one call's per-block stage trace as a Chrome/Perfetto trace file (GPU; across ranks: "
        "megamoe-rt launch -n N -m megamoe_rt.cli.trace ...)",
    )
    add_arguments(s)
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    from megamoe_rt.cli import trace

    trace.check_arguments(args)  # the trace file, before the GPU probe
    if commands.hopper_or_none("trace") is None:
        return 1
    return trace.run(args)
