"""``megamoe-rt scaleout``: the model of what each rank moves per call across nodes, and that
time floor against the GEMMs (no GPU)."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli.output import add_output_options, check_output, emit
from megamoe_rt.cli.usage import UsageError, csv, positive_number


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from megamoe_rt.presets import PRESETS

    s = subparsers.add_parser(
        "scaleout",
        help="model: bytes each rank moves per call across nodes, and that time floor against the GEMMs (no GPU)",
    )
    s.add_argument("--presets", "--preset", type=csv(str, sorted(PRESETS)), default=["flash", "pro", "v3"])
    s.add_argument("--ranks", type=csv(int), default=[16, 32], help="expert-parallel ranks (default 16,32)")
    s.add_argument("--tokens", type=csv(int), default=[128, 2048, 8192], help="tokens per rank (default 128,2048,8192)")
    s.add_argument(
        "--link-gbps",
        type=positive_number,
        default=400.0,
        help="per-GPU network bandwidth, Gb/s each way (default 400)",
    )
    s.add_argument(
        "--tflops",
        type=positive_number,
        default=780.0,
        help="the layer's GEMM rate (default 780, one H200's fused layer)",
    )
    add_output_options(s, "the rows")
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    check_output("megamoe-rt scaleout", args)
    from megamoe_rt.ep.scaleout_model import format_table, scaleout_cost
    from megamoe_rt.presets import get_preset

    presets = [get_preset(name) for name in args.presets]
    for ranks in args.ranks:  # every value checked before any row is computed
        if ranks < 2:
            raise UsageError(f"megamoe-rt scaleout: --ranks {ranks}: traffic between ranks needs at least 2 ranks")
        for preset in presets:
            if preset.num_experts % ranks:
                raise UsageError(
                    f"megamoe-rt scaleout: --ranks {ranks} does not divide {preset.name}'s {preset.num_experts} experts"
                )
    costs = []
    for preset in presets:
        for ranks in args.ranks:
            for t in args.tokens:
                costs.append(
                    scaleout_cost(preset, ranks, t, link_bytes_per_s=args.link_gbps * 1e9 / 8, tflops=args.tflops)
                )
    emit(args, [c.as_dict() for c in costs])
    if args.json:
        return 0
    print(
        f"per rank and call, uniform routing; link {args.link_gbps:g} Gb/s per GPU each way, GEMMs at {args.tflops:g} TFLOP/s"
    )
    print(format_table(costs))
    return 0
