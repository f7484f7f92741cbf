"""``megamoe-rt tune-split``: the split mode's K1/K2 SM counts swept for a shape, the fastest
stored (GPU); the sweep itself is megamoe_rt/cli/tune_split.py."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli import commands


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from megamoe_rt.cli.tune_split import add_arguments

    s = subparsers.add_parser(
        "tune-split", help="sweep the split mode's K1/K2 SM counts for a shape and store the fastest (GPU)"
    )
    add_arguments(s)
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    from megamoe_rt.cli import tune_split

    if not tune_split.check_arguments(args):  # output files and matplotlib, before the GPU probe
        return 1
    if commands.hopper_or_none("tune-split") is None:
        return 1
    return tune_split.run(args)
