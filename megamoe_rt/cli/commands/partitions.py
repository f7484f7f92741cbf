"""``megamoe-rt partitions``: which green-context SM partitions the GPU can form."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli import commands
from megamoe_rt.cli.output import add_output_options, check_output, emit


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    s = subparsers.add_parser("partitions", help="which green-context SM partitions the GPU can form")
    s.add_argument("--fine", action="store_true", help="ignore SM co-scheduling (pairs of SMs; no large clusters)")
    add_output_options(s, "the table")
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    check_output("megamoe-rt partitions", args)
    info = commands.hopper_or_none("partitions")
    if info is None:
        return 1
    from megamoe_rt.graph.green import partition_granularity, split_table

    rows = split_table(info.ordinal, fine=args.fine)
    gran = partition_granularity(info.ordinal, fine=args.fine)
    granted = sorted({g for _, g, _ in rows if g})
    result = {"device": info.name, "sm_count": info.sm_count, "fine": args.fine, "granularity": gran, "rows": rows}
    emit(args, result)
    if args.json:
        return 0
    print(
        f"device {info.ordinal}: {info.name}, {info.sm_count} SMs; SM co-scheduling "
        f"{'ignored' if args.fine else 'kept'}: partitions in multiples of {gran}"
    )
    print("a first partition split off the device can hold: " + ", ".join(map(str, granted)))
    print(f"{'asked':>6} {'granted':>8} {'left':>5}")
    for asked, got, left in rows:
        if asked % gran == 0:
            print(f"{asked:>6} {got:>8} {left:>5}")
    print('what is left is split again the same way (GreenPartitions), or taken whole as "rest"')
    return 0
