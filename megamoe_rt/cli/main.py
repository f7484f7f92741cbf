"""``megamoe-rt`` command line: info, plan, compile.

Invalid arguments exit with status 2 and one line on stderr. A command with a result takes
``--json`` (the result as JSON on stdout, alone) and ``-o/--output FILE`` (the JSON to FILE),
checked before any work (megamoe_rt/cli/output.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

from megamoe_rt.cli.output import add_output_options, check_output, check_writable, emit, progress_to_stderr
from megamoe_rt.cli.usage import (
    Parser,
    UsageError,
    csv,
    exit_status,
    mode,
    modes,
    positive_int,
    positive_number,
    positive_seconds,
)

# --- info -------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _nvshmem_status() -> str:
    import importlib.util

    host = "nvshmem4py " + (_dist_version("nvshmem4py-cu13") or _dist_version("nvshmem4py-cu12") or "missing")
    lib = _dist_version("nvidia-nvshmem-cu13") or _dist_version("nvidia-nvshmem-cu12")
    found = importlib.util.find_spec("nvshmem") is not None
    return f"{'available' if found and lib else 'not available'} ({host}, nvidia-nvshmem {lib or 'missing'})"


def info_report() -> tuple[list[tuple[str, str]], dict]:
    """What ``megamoe-rt info`` reports: its table's rows, and the same as JSON (``--json``)."""
    from megamoe_rt import __version__
    from megamoe_rt.jit import CubinCache, include_dirs
    from megamoe_rt.runtime import driver

    versions = {
        "megamoe_rt": __version__,
        "python": platform.python_version(),
        "numpy": _dist_version("numpy"),
        "ml_dtypes": _dist_version("ml-dtypes") or _dist_version("ml_dtypes"),
        "cuda-bindings": _dist_version("cuda-bindings"),
        "cupy": _dist_version("cupy-cuda13x") or _dist_version("cupy-cuda12x"),
        "cuda-core": _dist_version("cuda-core"),
    }
    rows: list[tuple[str, str]] = [(k, v or "missing") for k, v in versions.items()]
    result: dict = {"versions": versions}
    try:
        from megamoe_rt.jit import nvrtc_version

        result["nvrtc"] = "{}.{}".format(*nvrtc_version())
        rows.append(("nvrtc", result["nvrtc"]))
    except Exception as exc:
        result["nvrtc"] = None
        rows.append(("nvrtc", f"unavailable ({type(exc).__name__})"))
    result["headers"] = {name: str(path) if path else None for name, path in include_dirs().items()}
    rows += [(f"headers[{name}]", path or "not found") for name, path in result["headers"].items()]
    result["nvshmem"] = _nvshmem_status()
    rows.append(("nvshmem", result["nvshmem"]))
    cache = CubinCache()
    result["cache"] = {"directory": str(cache.directory), "entries": len(cache.entries())}
    rows.append(("cache", f"{cache.directory} ({result['cache']['entries']} entries)"))
    ver = driver.driver_version()
    result["driver_cuda"] = "{}.{}".format(*ver) if ver else None  # the CUDA version the driver supports
    rows.append(("driver", f"CUDA {result['driver_cuda']}" if ver else "not found"))
    devices = []
    if ver:
        try:
            devices = driver.list_devices()
        except driver.GpuUnavailableError as exc:  # e.g. cuda-core missing: say why, keep the report
            rows.append(("gpus", str(exc)))
            result["gpus_unavailable"] = str(exc)
    result["gpus"] = [
        {
            "ordinal": d.ordinal,
            "name": d.name,
            "sm_count": d.sm_count,
            "compute_capability": "{}.{}".format(*d.compute_capability),
            "total_memory_bytes": d.total_memory_bytes,
            "l2_cache_bytes": d.l2_cache_bytes,
            "is_hopper": d.is_hopper,
        }
        for d in devices
    ]
    return rows, result


def cmd_info(args) -> int:
    check_output("megamoe-rt info", args)
    rows, result = info_report()
    emit(args, result)
    if args.json:
        return 0
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not result["gpus"]:
        print("gpus" + " " * (width - 2) + "none")
    for d in result["gpus"]:
        mark = "" if d["is_hopper"] else "  (not sm_90: GPU paths unavailable)"
        print(
            f"gpu {d['ordinal']}: {d['name']}, {d['sm_count']} SMs, compute capability {d['compute_capability']}, "
            f"{d['total_memory_bytes'] / 2**30:.0f} GiB, L2 {d['l2_cache_bytes'] / 2**20:.0f} MiB{mark}"
        )
    return 0


# --- plan -------------------------------------------------------------------------------


I32_MAX = 2**31 - 1  # pool rows are addressed by 32-bit row indices (expert offsets, send lists)


def plan_token_limit(ranks: int, topk: int, local_experts: int, block_m: int, max_rows: int = I32_MAX) -> int:
    """The most tokens per rank (a multiple of the buffer's 128-token granularity) whose
    worst-case pool holds at most ``max_rows`` rows; 0 when not even 128 tokens fit."""
    from megamoe_rt.schedule.plan import TOKEN_ALIGN, pool_blocks_upper_bound

    def fits(units: int) -> bool:
        rows = pool_blocks_upper_bound(units * TOKEN_ALIGN, ranks, topk, local_experts, block_m) * block_m
        return rows <= max_rows

    lo, hi = 0, max_rows // TOKEN_ALIGN + 1  # a pool row per token at least: hi never fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * TOKEN_ALIGN


def _check_plan_tokens(args, preset, experts: int) -> None:
    """``--tokens`` within what the 32-bit pool row indices (and, for ``--mode fused`` or
    ``split``, the fused kernel's pool blocks) can address, before the planner overflows a counter."""
    from megamoe_rt.kernels.interface.fused import MAX_BLOCKS

    max_rows, room = I32_MAX, f"32-bit pool row indices: {I32_MAX:,} rows"
    if args.mode in ("fused", "split"):  # both run the fused kernel's block tables
        blocks = int(MAX_BLOCKS.value)
        max_rows, room = min(max_rows, blocks * args.block_m), f"the fused kernel's {blocks:,} pool blocks"
    limit = plan_token_limit(args.ranks, preset.num_topk, experts // args.ranks, args.block_m, max_rows)
    shape = f"{preset.name} with {experts} experts over {args.ranks} rank(s)"
    if limit == 0:
        raise UsageError(
            f"megamoe-rt plan: --experts {experts}: the worst-case pool of {shape} does not fit {room} "
            "even at 128 tokens per rank"
        )
    if args.tokens > limit:
        raise UsageError(
            f"megamoe-rt plan: --tokens {args.tokens}: {shape} takes at most {limit} tokens per rank "
            f"(its worst-case pool must fit {room})"
        )


def cmd_plan(args) -> int:
    check_output("megamoe-rt plan", args)
    from megamoe_rt.presets import get_preset
    from megamoe_rt.schedule.layout import symm_buffer_layout
    from megamoe_rt.schedule.plan import fused_schedule

    try:
        preset = get_preset(args.preset)
    except ValueError as exc:
        raise UsageError(f"megamoe-rt plan: {exc}") from None
    experts = args.experts or preset.num_experts
    ranks = args.ranks
    # Said in the options the user typed; the planner would name its own parameters.
    whose = f"--experts {experts}" if args.experts else f"the {preset.name} preset's {experts} experts"
    if experts % ranks:
        raise UsageError(f"megamoe-rt plan: --ranks {ranks} does not divide {whose}")
    if preset.num_topk > experts:  # only --experts can be this small
        raise UsageError(
            f"megamoe-rt plan: --experts {experts} is fewer than the {preset.name} preset's top-{preset.num_topk} "
            "(the experts each token is routed to)"
        )
    if args.mode is not None:  # the pool and block size the mode's layer allocates
        from megamoe_rt.modes.base import LayerSpec
        from megamoe_rt.modes.registry import MODES

        spec = LayerSpec(preset.hidden, preset.intermediate, experts, preset.num_topk, args.tokens, num_ranks=ranks)
        needs = MODES[args.mode].layout_needs(spec)
        args.block_m, args.pool = needs.block_m, needs.pool
    _check_plan_tokens(args, preset, experts)
    try:
        layout = symm_buffer_layout(
            preset.hidden,
            preset.intermediate,
            experts,
            preset.num_topk,
            args.tokens,
            ranks,
            block_m=args.block_m,
            act_sf_gran=args.act_sf_gran,
            pool=args.pool,
        )
        sched = fused_schedule(layout.num_max_tokens_per_rank, ranks, preset.num_topk, experts, block_m=args.block_m)
    except ValueError as exc:
        raise UsageError(f"megamoe-rt plan: {exc}") from None
    except OverflowError as exc:  # a 32-bit counter of the kernels' workspace, sized by the experts
        raise UsageError(
            f"megamoe-rt plan: --experts {experts} over --ranks {ranks}: a 32-bit workspace counter overflows ({exc})"
        ) from None
    emit(
        args,
        {
            "preset": preset.name,
            "hidden": preset.hidden,
            "intermediate": preset.intermediate,
            "num_experts": experts,
            "num_local_experts": layout.num_local_experts,
            "num_topk": preset.num_topk,
            "num_max_tokens_per_rank": layout.num_max_tokens_per_rank,
            "num_ranks": ranks,
            "pool": layout.pool,
            "pool_blocks": layout.pool_blocks,
            "pool_rows": layout.pool_rows,
            "block_m": layout.block_m,
            "fused_lag_units": sched.lag_units,
            "fused_group_units": sched.group_units,
            "fused_ring_blocks": sched.ring_blocks,
            "total_bytes": layout.total_bytes,
            "regions": [{"name": n, "bytes": b, "mib": round(m, 4)} for n, b, m in layout.report()],
        },
    )
    if args.json:
        return 0
    print(
        f"preset {preset.name}: hidden {preset.hidden}, intermediate {preset.intermediate}, "
        f"{experts} experts ({layout.num_local_experts} per rank), top-{preset.num_topk}, "
        f"{ranks} rank(s), {layout.num_max_tokens_per_rank} tokens/rank capacity"
    )
    print(
        f"pool: {layout.pool}, {layout.pool_blocks} blocks x {layout.block_m} rows = {layout.pool_rows} rows; "
        f"fused schedule: lag {sched.lag_units} units, group {sched.group_units}, ring {sched.ring_blocks} blocks"
        f"{' (covers the full pool)' if sched.covers_full_pool else ''}"
    )
    print(layout.format_report())
    return 0


# --- compile ----------------------------------------------------------------------------


def cmd_compile(args) -> int:
    from megamoe_rt.kernels.registry import all_kernel_specs

    specs = all_kernel_specs()
    if args.list:
        if args.names or args.all:
            raise UsageError("megamoe-rt compile: --list takes no kernel names and no --all")
        print("\n".join(s.name for s in specs))
        return 0
    if args.all:
        chosen = specs
    else:
        if not args.names:
            raise UsageError("megamoe-rt compile: name kernels or pass --all (--list shows them)")
        by_name = {s.name: s for s in specs}
        unknown = [n for n in args.names if n not in by_name]
        if unknown:  # one line: up to three names near it (for a family's prefix, its first variants)
            import difflib

            name, known = unknown[0], list(by_name)
            near = [k for k in known if k.startswith(name)][:3] or difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean: {', '.join(near)}?" if near else ""
            raise UsageError(
                f"megamoe-rt compile: unknown kernel {name!r}{hint} (megamoe-rt compile --list shows all {len(known)})"
            )
        chosen = [by_name[n] for n in args.names]
    check_output("megamoe-rt compile", args)  # before the builds, which take a minute for --all
    from megamoe_rt.requirements import compiler_or_report

    if not compiler_or_report("megamoe-rt compile"):  # NVRTC or a header wheel missing: one line, not NVRTC's traceback
        return 1
    from megamoe_rt.cli.compile_kernels import build_kernels

    try:  # a progress line per kernel on stderr as it finishes; the results below in this order
        results = build_kernels(chosen, jobs=args.jobs, lineinfo=args.lineinfo, use_cache=not args.no_cache)
    except KeyboardInterrupt:  # the workers are ended: one line, no traceback
        print("megamoe-rt compile: interrupted", file=sys.stderr)
        return 130
    if args.json or args.output:
        out = []
        for c in results:
            d = c.resources.as_dict()
            d.update(
                lowered_name=c.lowered_name,
                source=c.spec.source,
                cache_key=c.cache_key,
                from_cache=c.from_cache,
                compile_seconds=round(c.compile_seconds, 3),
                block_threads=c.spec.block_threads,
            )
            out.append(d)
        emit(args, out)
        if args.json:
            return 0
    header = f"{'kernel':<34} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem B':>8} {'cached':>7} {'sec':>6}"
    print(header)
    print("-" * len(header))
    for c in results:
        r = c.resources
        print(
            f"{c.spec.name:<34} {r.registers:>5} {r.spill_bytes:>8} {r.stack_frame_bytes:>8} "
            f"{r.smem_bytes:>8} {'yes' if c.from_cache else 'no':>7} {c.compile_seconds:>6.2f}"
        )
    return 0


# --- bench ------------------------------------------------------------------------------


def _hopper_or_none(command: str):
    """The GPU to run on, or None after printing the one-line reason (exit status 1): the GPU
    stack missing, no driver, no Hopper GPU (megamoe_rt/requirements.py)."""
    from megamoe_rt.requirements import gpu_or_report

    return gpu_or_report(f"megamoe-rt {command}")


MOE_TOKENS = [64, 256, 2048, 8192]  # bench moe's default tokens


def _check_capacity(args) -> None:
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


def cmd_bench(args) -> int:
    _check_capacity(args)
    prog = f"megamoe-rt bench {args.what}"
    check_output(prog, args)
    check_writable(prog, "--png", args.png)
    if args.png is not None:
        from megamoe_rt.cli.plotting import plotting_or_report

        if not plotting_or_report(prog, "--png"):
            return 1
    info = _hopper_or_none("bench")
    if info is None:
        return 1
    with progress_to_stderr(args):
        rows = _run_bench(args, info)
    emit(args, rows, written=True)  # the benchmarks write the -o file themselves, after every cell
    return 0


def _run_bench(args, info) -> list[dict]:
    from megamoe_rt.cli.benchmarks import bench_gemm, bench_moe

    print(f"device {info.ordinal}: {info.name}, {info.sm_count} SMs")
    chosen_modes = args.mode or ["unfused"]
    presets = args.presets or ["flash", "pro", "v3"]
    if args.what == "prefill":
        from megamoe_rt.cli.bench_prefill import MODES, RATIOS, TOKENS, bench_prefill

        return bench_prefill(
            presets,
            args.tokens or TOKENS,
            modes=args.mode or MODES,
            ratios=args.ratios or RATIOS,
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
        )
    return bench_moe(
        presets,
        args.tokens or MOE_TOKENS,
        mode=chosen_modes,
        rounds=args.rounds,
        capacity=args.capacity,
        json_path=args.output,
    )


# --- partitions -------------------------------------------------------------------------


def cmd_partitions(args) -> int:
    check_output("megamoe-rt partitions", args)
    info = _hopper_or_none("partitions")
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


# --- sweep ------------------------------------------------------------------------------


def cmd_tune_split(args) -> int:
    from megamoe_rt.cli.tune_split import check_arguments, run

    if not check_arguments(args):  # output files and matplotlib, before the GPU probe
        return 1
    if _hopper_or_none("tune-split") is None:
        return 1
    return run(args)


def cmd_trace(args) -> int:
    from megamoe_rt.cli.trace import check_arguments, run

    check_arguments(args)  # the trace file, before the GPU probe
    if _hopper_or_none("trace") is None:
        return 1
    return run(args)


def cmd_sweep(args) -> int:
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
    info = _hopper_or_none("sweep")
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


# --- launch -----------------------------------------------------------------------------


def cmd_scaleout(args) -> int:
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


def cmd_launch(args) -> int:
    from megamoe_rt.ep.launch import launch_script

    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"megamoe-rt launch: script {args.script!r} not found")
    try:
        return launch_script(
            args.nprocs, args.script, args.script_args, timeout=args.timeout, module=args.module, devices=args.devices
        )
    except ValueError as exc:  # --devices that do not fit -n
        raise UsageError(f"megamoe-rt launch: {exc}") from None


# --- demo -------------------------------------------------------------------------------


def cmd_demo(args) -> int:
    check_output("megamoe-rt demo", args)
    info = _hopper_or_none("demo")
    if info is None:
        return 1
    from megamoe_rt.cli.demo import run_demo

    with progress_to_stderr(args):
        result = run_demo(args.preset, args.tokens, check_tokens=args.check_tokens, device=info, mode=args.mode)
    emit(args, result)
    return 0 if result["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    from megamoe_rt import __version__
    from megamoe_rt.presets import PRESETS

    p = Parser(prog="megamoe-rt", description="Expert-parallel FP8 MoE runtime for Hopper GPUs.")
    p.add_argument("--version", action="version", version=f"megamoe-rt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    s = sub.add_parser("info", help="package, compiler and driver versions; GPUs; NVSHMEM; cache")
    add_output_options(s, "the report")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("partitions", help="which green-context SM partitions the GPU can form")
    s.add_argument("--fine", action="store_true", help="ignore SM co-scheduling (pairs of SMs; no large clusters)")
    add_output_options(s, "the table")
    s.set_defaults(func=cmd_partitions)

    s = sub.add_parser("plan", help="symmetric-buffer memory report and pool sizes (no GPU needed)")
    s.add_argument("--preset", default="flash", choices=sorted(PRESETS), help="model shape (default flash)")
    s.add_argument("--tokens", type=positive_int, default=8192, help="max tokens per rank (default 8192)")
    s.add_argument("--ranks", type=positive_int, default=8, help="expert-parallel ranks (default 8)")
    s.add_argument("--experts", type=positive_int, default=None, help="total experts (default: the preset's)")
    s.add_argument(
        "--mode",
        type=mode,
        default=None,
        help="the buffer a MegaMoE of this mode allocates (sets --block-m and --pool)",
    )
    s.add_argument("--pool", choices=("full", "ring"), default="full")
    s.add_argument("--block-m", type=int, choices=(64, 128), default=128)
    s.add_argument("--act-sf-gran", type=int, choices=(64, 128), default=128)
    add_output_options(s, "the report")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("compile", help="build kernel variants into the cache and print their resources")
    s.add_argument("names", nargs="*", help="kernel variant names")
    s.add_argument("--all", action="store_true", help="every kernel variant")
    add_output_options(s, "the kernels' resources (instead of the table)")
    s.add_argument("--lineinfo", action="store_true", help="compile with -lineinfo")
    s.add_argument("--no-cache", action="store_true", help="compile even where a cached cubin exists")
    s.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        default=None,
        help="build in this many processes (default: the usable cores; 1: in this process)",
    )
    s.add_argument("--list", action="store_true", help="print the kernel variant names, one a line, and exit")
    s.set_defaults(func=cmd_compile)

    s = sub.add_parser("demo", help="run one MoE layer on random inputs and check it against the reference")
    s.add_argument("--preset", default="flash", choices=sorted(PRESETS), help="model shape (EP8 per-rank slice)")
    s.add_argument("--tokens", type=positive_int, default=2048, help="tokens (default 2048)")
    s.add_argument(
        "--check-tokens", type=positive_int, default=64, help="tokens checked against the NumPy reference (default 64)"
    )
    s.add_argument(
        "--mode",
        type=mode,
        default=None,
        help="execution mode (default: the layer's, fused where the shape allows)",
    )
    add_output_options(s, "the result (check, time, TFLOP/s)")
    s.set_defaults(func=cmd_demo)

    from megamoe_rt.cli.tune_split import add_arguments as add_tune_split_arguments

    s = sub.add_parser(
        "tune-split", help="sweep the split mode's K1/K2 SM counts for a shape and store the fastest (GPU)"
    )
    add_tune_split_arguments(s)
    s.set_defaults(func=cmd_tune_split)

    from megamoe_rt.cli.trace import add_arguments as add_trace_arguments

    s = sub.add_parser(
        "trace",
        help="one call's per-block stage trace as a Chrome/Perfetto trace file (GPU; across ranks: "
        "megamoe-rt launch -n N -m megamoe_rt.cli.trace ...)",
    )
    add_trace_arguments(s)
    s.set_defaults(func=cmd_trace)

    s = sub.add_parser(
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
    s.set_defaults(func=cmd_scaleout)

    s = sub.add_parser("launch", help="run a script as N ranks, one process per GPU")
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
    s.set_defaults(func=cmd_launch)

    s = sub.add_parser("sweep", help="run a pipeline spec's graph, once or across SM splits of one partition")
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
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("bench", help="benchmarks on a Hopper GPU (CUDA-event device time, arms bracketed in rounds)")
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
        help="moe, overhead, prefill: execution mode(s), comma-separated (unfused, fused, split); moe brackets "
        "them in rounds (default unfused; prefill: all three)",
    )
    s.add_argument(
        "--ratios",
        type=csv(float),
        default=None,
        help="prefill: rings as shares of the worst-case pool (chunk_ratio), besides the full pool "
        "(default 0.5,0.25,0.125)",
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
        "--tokens",
        type=csv(int),
        default=None,
        help="tokens per rank, EP8 slice (gemm default 512,2048,8192; moe default 64,256,2048,8192)",
    )
    s.add_argument("--rounds", type=positive_int, default=3)
    s.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer arms")
    add_output_options(s, "the rows")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()

    def command() -> int:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)

    return exit_status(command)


if __name__ == "__main__":
    sys.exit(main())
