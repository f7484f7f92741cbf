"""The layer benchmark across launched ranks:
``megamoe-rt launch -n 2 -m megamoe_rt.cli.bench moe --preset flash --tokens 2048``.

Each rank runs a preset's EP8 per-rank slice (E/8 local experts) so per-GPU numbers compare
with the one-GPU benchmark at the same slice; routing is uniform over all ranks' experts.
Device time per rank (the method of megamoe_rt/cli/timing.py, graph replay), reported as the slowest rank; useful
TFLOP/s per GPU; NVLink GB/s per rank from the bytes that cross ranks (the pulled x rows,
scales and send-list entries, and the bf16 partials returned) against the ~395 GB/s copy
ceiling measured on these GPUs.

``main_ep`` also runs ``overhead``, ``prefill`` and ``stream`` across ranks (cli/bench_overhead.py,
cli/bench_prefill.py, cli/bench_stream.py), with the same options read by ``ep_arguments``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs
from megamoe_rt.cli.output import (
    add_output_options,
    check_output,
    check_writable,
    print_json,
    progress_to_stderr,
    write_json,
)
from megamoe_rt.cli.timing import DeviceTimer, bracketed, capture_layer_call, every_rank
from megamoe_rt.cli.usage import Parser, UsageError, csv, modes, positive_int, report

NVLINK_BYTES_PER_S = 395e9


def bench_moe_ep(
    ctx, presets: list[str], tokens: list[int], *, modes: list[str], rounds: int, json_path: str | None
) -> list[dict]:
    import cupy as cp

    from megamoe_rt.layer import MegaMoE

    cp.cuda.Device(ctx.device).use()
    world = ctx.world_size
    rows = []
    for name, p, local, experts, t in preset_slices(presets, tokens, world):
        args, weights = rank_inputs(cp, ctx.rank, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
        ids = args[2]
        remote = int(cp.count_nonzero((ids // local) != ctx.rank))
        stream = cp.cuda.Stream(non_blocking=True)
        layers = {}
        arms: dict[str, Callable[[], None]] = {}
        for m in modes:
            mode, _, transport = m.partition("@")  # "unfused@nvshmem": an arm with its transport forced
            layer = MegaMoE(
                p.hidden, p.intermediate, experts, p.num_topk, t, mode=mode, group=ctx, transport=transport or "auto"
            )
            layer.load_weights(*weights)
            y = cp.empty((t, p.hidden), dtype=cp.uint16)
            graph = capture_layer_call(layer, args, y, stream)
            layers[m] = layer
            arms[m] = functools.partial(graph.launch, stream=stream)
        with stream:
            results = bracketed(DeviceTimer(), arms, rounds=rounds)
        mine = {m: results[m].median_us for m in modes}
        everyone = every_rank(ctx, mine, key="bench-ep")
        cross = remote * (p.hidden + p.hidden // 128 * 4 + 8 + 2 * p.hidden)
        for m in modes:
            slowest = max(e[m] for e in everyone)
            pairs_per_gpu = t * p.num_topk
            row = {
                "preset": name,
                "tokens_per_rank": t,
                "ranks": world,
                "mode": m,
                "local_experts": local,
                "median_us_slowest_rank": slowest,
                "median_us_per_rank": [e[m] for e in everyone],
                "tflops_per_gpu": layers[m].flops(pairs_per_gpu) / (slowest * 1e-6) / 1e12,
                "nvlink_gbps_rank": cross / (mine[m] * 1e-6) / 1e9,
                "nvlink_ceiling_gbps": NVLINK_BYTES_PER_S / 1e9,
                "buffer_mib": layers[m].layout.total_bytes / 2**20,
            }
            rows.append(row)
            if ctx.rank == 0:
                print(
                    f"{name:>5} T={t:<5}/rank EP{world} {m:>8}: {slowest:9.1f} us (slowest rank)  "
                    f"{row['tflops_per_gpu']:7.1f} TFLOP/s/GPU  NVLink {row['nvlink_gbps_rank']:6.1f} GB/s "
                    f"(rank 0, ceiling 395)  buffer {row['buffer_mib']:8.1f} MiB",
                    flush=True,
                )
        ctx.barrier()
        for layer in layers.values():
            layer.close()
        del layers, arms, args, weights
        cp.get_default_memory_pool().free_all_blocks()
    if json_path and ctx.rank == 0:
        write_json(json_path, rows)
    return rows


def ep_arguments(argv: list[str], what: str = "moe") -> argparse.Namespace:
    """The options of a benchmark across ranks; prefill's defaults are those of
    ``megamoe-rt bench prefill`` but for the tokens (the pool grows with the rank count),
    stream's those of ``megamoe-rt bench stream`` (tokens per rank). A bad option: one line
    on stderr and SystemExit(2)."""
    from megamoe_rt.cli import bench_stream
    from megamoe_rt.cli.bench_prefill import EP_TOKENS, MODES, RATIOS, WINDOWS
    from megamoe_rt.modes.registry import baseline_mode
    from megamoe_rt.presets import PRESETS

    prefill, stream = what == "prefill", what == "stream"
    tokens = EP_TOKENS if prefill else bench_stream.TOKENS if stream else [64, 256, 2048, 8192]
    ap = Parser(prog=f"megamoe_rt.cli.bench {what} (across ranks)")
    ap.add_argument(
        "--presets",
        "--preset",
        dest="presets",
        default=bench_stream.PRESETS if stream else ["flash"],
        type=csv(str, sorted(PRESETS)),
    )
    ap.add_argument("--tokens", default=tokens, type=csv(int), help="tokens per rank")
    ap.add_argument(
        "--mode",
        default=MODES if prefill else [baseline_mode()],
        type=functools.partial(modes, transports=what == "moe"),
        help="modes, comma-separated; moe: MODE@TRANSPORT forces a transport (unfused@nvshmem,unfused@nvlink)",
    )
    ap.add_argument(
        "--ratios",
        default=RATIOS,
        type=csv(float),
        help="prefill: rings as shares of the worst-case pool (chunk_ratio), besides the full pool",
    )
    ap.add_argument(
        "--windows",
        default=WINDOWS,
        type=csv(int),
        help="prefill: token windows (token_window), a row each where shorter than the call",
    )
    ap.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="prefill: a bar chart of time against the full pool (rank 0; matplotlib)",
    )
    ap.add_argument("--slots", type=positive_int, default=4, help="stream: input ring slots")
    ap.add_argument("--chunk", type=positive_int, default=512, help="stream: tokens per slot (chunk)")
    ap.add_argument("--rounds", type=positive_int, default=3)
    add_output_options(ap, "the rows (rank 0)")
    try:
        return ap.parse_args(argv)
    except UsageError as exc:  # one line on stderr, then argparse's exit status 2 (each rank exits alike)
        raise SystemExit(report(exc)) from None


def check_files(a: argparse.Namespace, what: str) -> bool:
    """The files rank 0 will write (a one-line SystemExit(2) naming the option, on every rank
    alike) and matplotlib for ``--png`` (False after one line saying it is missing)."""
    prog = f"megamoe_rt.cli.bench {what} (across ranks)"
    try:
        check_output(prog, a)
        check_writable(prog, "--png", a.png)
    except UsageError as exc:
        raise SystemExit(report(exc)) from None
    if a.png is None:
        return True
    from megamoe_rt.cli.plotting import plotting_or_report

    return plotting_or_report(prog, "--png")


def main_ep(argv: list[str], what: str = "moe") -> int:
    a = ep_arguments(argv, what)  # bad arguments: SystemExit(2) before any GPU work
    if not check_files(a, what):
        return 1

    from megamoe_rt.ep.launch import context_from_env
    from megamoe_rt.requirements import gpu_or_report

    ctx = context_from_env()
    if gpu_or_report("megamoe-rt bench", ctx.device) is None:  # one line for the launcher to print once
        return 1

    import cupy as cp

    from megamoe_rt.ep.group import ranks_share_a_gpu
    from megamoe_rt.ep.symm import NvshmemRuntime

    cp.cuda.Device(ctx.device).use()
    if ranks_share_a_gpu(ctx) and ctx.rank == 0:
        print(
            "megamoe-rt bench: WARNING: ranks share a GPU (MEGAMOE_RT_RANK_DEVICES) and take turns on it; "
            "the times below do not measure expert parallelism",
            file=sys.stderr,
            flush=True,
        )
    with progress_to_stderr(a):
        rows = _run(ctx, a, what)
    if a.json and ctx.rank == 0:  # rank 0 writes the -o file after every cell, and prints the rows
        print_json(rows)
    NvshmemRuntime.initialize(ctx).finalize()
    return 0


def _run(ctx, a: argparse.Namespace, what: str) -> list[dict]:
    if what == "overhead":
        from megamoe_rt.cli.bench_overhead import bench_overhead

        return bench_overhead(a.presets, a.tokens, modes=a.mode, rounds=a.rounds, group=ctx, json_path=a.output)
    if what == "prefill":
        from megamoe_rt.cli.bench_prefill import bench_prefill

        return bench_prefill(
            a.presets,
            a.tokens,
            modes=a.mode,
            ratios=a.ratios,
            windows=a.windows,
            rounds=a.rounds,
            group=ctx,
            json_path=a.output,
            png_path=a.png,
        )
    if what == "stream":
        from megamoe_rt.cli.bench_stream import bench_stream

        return bench_stream(
            a.presets, a.tokens, slots=a.slots, chunk=a.chunk, rounds=a.rounds, group=ctx, json_path=a.output
        )
    return bench_moe_ep(ctx, a.presets, a.tokens, modes=a.mode, rounds=a.rounds, json_path=a.output)
