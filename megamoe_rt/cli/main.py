"""``megamoe-rt`` command line: the parser and the dispatch to one module per command
(megamoe_rt/cli/commands/).

Invalid arguments exit with status 2 and one line on stderr. A command with a result takes
``--json`` (the result as JSON on stdout, alone) and ``-o/--output FILE`` (the JSON to FILE),
checked before any work (megamoe_rt/cli/output.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megamoe_rt.cli.commands import bench, demo, info, launch, partitions, plan, scaleout, sweep, trace, tune_split
from megamoe_rt.cli.commands import compile as compile_  # the module, not the builtin
from megamoe_rt.cli.usage import Parser, exit_status

# The subcommands, in the order --help lists them.
COMMANDS = (info, partitions, plan, compile_, demo, tune_split, trace, scaleout, launch, sweep, bench)


def build_parser() -> argparse.ArgumentParser:
    from megamoe_rt import __version__

    p = Parser(prog="megamoe-rt", description="Expert-parallel FP8 MoE runtime for Hopper GPUs.")
    p.add_argument("--version", action="version", version=f"megamoe-rt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()

    def command() -> int:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)

    return exit_status(command)


if __name__ == "__main__":
    sys.exit(main())
