"""``megamoe-rt demo``: one MoE layer on random inputs, checked against the reference (GPU)."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli import commands
from megamoe_rt.cli.output import add_output_options, check_output, emit, progress_to_stderr
from megamoe_rt.cli.usage import mode, positive_int
from megamoe_rt.modes.registry import default_mode


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from megamoe_rt.presets import PRESETS

    s = subparsers.add_parser("demo", help="run one MoE layer on random inputs and check it against the reference")
    s.add_argument("--preset", default="flash", choices=sorted(PRESETS), help="model shape (EP8 per-rank slice)")
    s.add_argument("--tokens", type=positive_int, default=2048, help="tokens (default 2048)")
    s.add_argument(
        "--check-tokens", type=positive_int, default=64, help="tokens checked against the NumPy reference (default 64)"
    )
    s.add_argument(
        "--mode",
        type=mode,
        default=None,
        help=f"execution mode (default: the layer's, {default_mode()} where the shape allows)",
    )
    add_output_options(s, "the result (check, time, TFLOP/s)")
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    check_output("megamoe-rt demo", args)
    info = commands.hopper_or_none("demo")
    if info is None:
        return 1
    from megamoe_rt.cli.demo import run_demo

    with progress_to_stderr(args):
        result = run_demo(args.preset, args.tokens, check_tokens=args.check_tokens, device=info, mode=args.mode)
    emit(args, result)
    return 0 if result["ok"] else 1
