"""``megamoe-rt bench gemm|moe|overhead|prefill|stream``: the benchmarks on one Hopper GPU (the
benchmarks themselves: megamoe_rt/cli/benchmarks.py, bench_overhead.py, bench_prefill.py,
bench_stream.py; across ranks: megamoe_rt/cli/bench.py)."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli import commands
from megamoe_rt.cli.output import add_output_options, check_output, check_writable, emit, progress_to_stderr
from megamoe_rt.cli.usage import UsageError, csv, gemm_tiles, modes, positive_int
from megamoe_rt.modes.registry import baseline_mode, mode_names

MOE_TOKENS = [64, 256, 2048, 8192]  # bench moe's default tokens


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from megamoe_rt.presets import PRESETS

    names = mode_names()
    every = "all three" if len(names) == 3 else "all"  # prefill's default: every mode
    s = subparsers.add_parser(
        "bench", help="benchmarks on a Hopper GPU (CUDA-event device time, arms bracketed in rounds)"
    )
    s.add_argument(
        "what",
        choices=("gemm", "moe", "overhead", "prefill", "stream"),
        help="what to measure (overhead: eager layer calls against graph replays, default tokens 64,2048; "
        "prefill: long calls against the ring size, default tokens 16384,32768,65536; across ranks: "
        "megamoe-rt launch -n N -m megamoe_rt.cli.bench prefill|stream ...; stream: a router and the layer, "
        "streamed against sequential, default flash,v3 at 512,2048,8192)",
    )
    s.add_argument(
        "--mode",
        type=modes,
        default=None,
        help=f"moe, overhead, prefill: execution mode(s), comma-separated ({', '.join(names)}); moe brackets "
        f"them in rounds (default {baseline_mode()}; prefill: {every})",
    )
    s.add_argument(
        "--ratios",
        type=csv(float),
        default=None,
        help="prefill: rings as shares of the worst-case pool (chunk_ratio), besides the full pool "
        "(default 0.5,0.25,0.125)",
    )
    s.add_argument(
        "--windows",
        type=csv(int),
        default=None,
        help="prefill: token windows (token_window), a row each where shorter than the call (default 16384)",
    )
    s.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="prefill: write a bar chart of time against the full pool (matplotlib)",
    )
    s.add_argument(
        "--capacity",
        type=positive_int,
        default=None,
        help="moe: buffer token capacity (default: each row's tokens; the fused arm passes num_tokens_bound = tokens)",
    )
    s.add_argument(
        "--presets",
        "--preset",
        type=csv(str, sorted(PRESETS)),
        default=None,
        help="default flash,pro,v3 (stream: flash,v3)",
    )
    s.add_argument("--slots", type=positive_int, default=4, help="stream: input ring slots")
    s.add_argument("--chunk", type=positive_int, default=512, help="stream: tokens per slot (chunk)")
    s.add_argument(
        "--producer-sms",
        type=positive_int,
        default=None,
        help="stream: SMs the fused mode's streamed call leaves to the router (default: an eighth of the GPU's)",
    )
    s.add_argument(
        "--tokens",
        type=csv(int),
        default=None,
        help="tokens per rank, EP8 slice (gemm default 512,2048,8192; moe default 64,256,2048,8192)",
    )
    s.add_argument("--rounds", type=positive_int, default=3)
    s.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer arms")
    s.add_argument(
        "--tiles",
        type=gemm_tiles,
        default=(),
        metavar="MxN[,MxN]",
        help="gemm: an arm per forced tile beside the heuristic's, e.g. 128x128,128x256,128x128c2 "
        "(c2: CTA pairs sharing the A tile)",
    )
    add_output_options(s, "the rows")
    s.set_defaults(func=run)
    return s


def _check_capacity(args: argparse.Namespace) -> None:
    """``bench moe --capacity``: at least every row's tokens (a call cannot exceed its buffer)."""
    if args.capacity is None:
        return
    if args.what != "moe":
        raise UsageError(f"megamoe-rt bench {args.what}: --capacity is an option of bench moe only")
    largest = max(args.tokens or MOE_TOKENS)
    if args.capacity < largest:
        raise UsageError(
            f"megamoe-rt bench moe: --capacity {args.capacity} is below the largest --tokens value {largest} "
            "(a call cannot exceed the buffer's token capacity)"
        )


def run(args: argparse.Namespace) -> int:
    _check_capacity(args)
    prog = f"megamoe-rt bench {args.what}"
    check_output(prog, args)
    check_writable(prog, "--png", args.png)
    if args.png is not None:
        from megamoe_rt.cli.plotting import plotting_or_report

        if not plotting_or_report(prog, "--png"):
            return 1
    info = commands.hopper_or_none("bench")
    if info is None:
        return 1
    with progress_to_stderr(args):
        rows = _run_bench(args, info)
    emit(args, rows, written=True)  # the benchmarks write the -o file themselves, after every cell
    return 0


def _run_bench(args: argparse.Namespace, info: Any) -> list[dict]:
    from megamoe_rt.cli.benchmarks import bench_gemm, bench_moe

    print(f"device {info.ordinal}: {info.name}, {info.sm_count} SMs")
    chosen_modes = args.mode or [baseline_mode()]
    presets = args.presets or ["flash", "pro", "v3"]
    if args.what == "prefill":
        from megamoe_rt.cli.bench_prefill import MODES, RATIOS, TOKENS, WINDOWS, bench_prefill

        return bench_prefill(
            presets,
            args.tokens or TOKENS,
            modes=args.mode or MODES,
            ratios=args.ratios or RATIOS,
            windows=args.windows or WINDOWS,
            rounds=args.rounds,
            json_path=args.output,
            png_path=args.png,
        )
    if args.what == "stream":
        from megamoe_rt.cli.bench_stream import PRESETS as STREAM_PRESETS
        from megamoe_rt.cli.bench_stream import TOKENS as STREAM_TOKENS
        from megamoe_rt.cli.bench_stream import bench_stream

        return bench_stream(
            args.presets or STREAM_PRESETS,
            args.tokens or STREAM_TOKENS,
            slots=args.slots,
            chunk=args.chunk,
            producer_sms=args.producer_sms,
            rounds=args.rounds,
            json_path=args.output,
        )
    if args.what == "overhead":
        from megamoe_rt.cli.bench_overhead import bench_overhead

        return bench_overhead(
            presets,
            args.tokens or [64, 2048],
            modes=chosen_modes,
            rounds=args.rounds,
            json_path=args.output,
        )
    if args.what == "gemm":
        return bench_gemm(
            presets,
            args.tokens or [512, 2048, 8192],
            with_torch=not args.no_torch,
            rounds=args.rounds,
            json_path=args.output,
            tiles=args.tiles,
        )
    return bench_moe(
        presets,
        args.tokens or MOE_TOKENS,
        mode=chosen_modes,
        rounds=args.rounds,
        capacity=args.capacity,
        json_path=args.output,
    )
