"""``megamoe-rt tune-split --preset P --tokens T [--ranks R]``: the split mode's K1/K2 SMs.

For one shape (the preset's EP8 per-rank slice, ``T`` tokens per rank) it times a split-mode
layer at each K1 count of :func:`~megamoe_rt.schedule.split_sms.sweep_split_sms` (K2 takes
every SM left, K3 the whole device), with the fused mode as the yardstick, and prints a
table as it goes. The fastest split is stored in the tuning cache
(:mod:`megamoe_rt.graph.split_tuning`), which ``MegaMoE(mode="split")`` reads by default.
Across ranks (``--ranks R``, re-run under ``megamoe-rt launch``) a split's time is that of
the slowest rank. Timing as in ``megamoe-rt bench moe`` (graph replays, bracketed rounds).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs
from megamoe_rt.cli.output import (
    add_output_options,
    check_output,
    check_writable,
    print_json,
    progress_to_stderr,
    write_json,
)
from megamoe_rt.cli.timing import DeviceTimer, capture_layer_call
from megamoe_rt.cli.usage import Parser, UsageError, exit_status, positive_int
from megamoe_rt.modes.registry import FUSED_KERNEL, SM_PARTITIONED, default_mode
from megamoe_rt.schedule.split_sms import SplitSms, sweep_split_sms, valid_l1_counts

TUNED = SM_PARTITIONED[0]  # the mode whose SM counts are swept
YARDSTICK = default_mode(FUSED_KERNEL)  # the same kernel in one launch over every SM


def _slowest(group: Any, value: float) -> float:
    if group is None:
        return value
    everyone = [
        float(group.broadcast(repr(value).encode() if group.rank == r else None, key="tune-split", root=r))
        for r in range(group.world_size)
    ]
    return max(everyone)


def split_candidates(sm_count: int, granularity: int, step: int | None) -> list[SplitSms]:
    """The splits to time on this device; a UsageError naming ``--step`` when it leaves none
    (checked once the GPU's SM count is known, before anything is timed)."""
    candidates = sweep_split_sms(sm_count, granularity, step)
    if candidates:
        return candidates
    lo, hi = sm_count // 4, sm_count * 7 // 8
    swept = [l1 for l1 in valid_l1_counts(sm_count, granularity) if lo <= l1 <= hi]
    if not swept:
        raise UsageError(
            f"megamoe-rt tune-split: this {sm_count}-SM device has no K1 count to sweep (multiples of "
            f"{granularity} from {lo} to {hi} SMs)"
        )
    # K1 takes the granularity plus a multiple of the step: the largest step that reaches a count.
    most = max(l1 - granularity for l1 in swept)
    raise UsageError(
        f"megamoe-rt tune-split: --step {step} leaves no K1 count to try on this {sm_count}-SM device "
        f"(K1 counts are {granularity} plus multiples of the step, between {lo} and {hi} SMs); the largest "
        f"step that leaves one is {most}"
    )


def tune_split(
    preset: str,
    tokens: int,
    *,
    group: Any = None,
    step: int | None = None,
    json_path: str | None = None,
    png_path: str | None = None,
    store: bool = True,
) -> dict:
    """Time the fused mode and every split; the result (rows, the best split), the same on every
    rank. Rank 0 prints, stores the best split and writes ``json_path`` and ``png_path``."""
    import cupy as cp

    from megamoe_rt.graph import split_tuning
    from megamoe_rt.graph.green import partition_granularity
    from megamoe_rt.layer import MegaMoE
    from megamoe_rt.runtime import devices

    rank, world = (0, 1) if group is None else (group.rank, group.world_size)
    device = 0 if group is None else group.device
    cp.cuda.Device(device).use()
    info = devices.require_hopper(device)
    granularity = partition_granularity(device)
    candidates = split_candidates(info.sm_count, granularity, step)
    name, p, local, experts, t = next(iter(preset_slices([preset], [tokens], world)))
    args, weights = rank_inputs(cp, rank, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
    timer = DeviceTimer()
    stream = cp.cuda.Stream(non_blocking=True)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"tune-split {name} T={t}/rank x{world} ranks on {info.name} ({info.sm_count} SMs, partitions of "
        f"{granularity}): {len(candidates)} splits + {YARDSTICK}",
        flush=True,
    )
    rows: list[dict] = []
    for n, sms in enumerate([None, *candidates]):
        label = YARDSTICK if sms is None else f"K1 {sms.l1:>3} | K2 {sms.l2:>3} | K3 {sms.reduce:>3}"
        kw = {"mode": YARDSTICK} if sms is None else {"mode": TUNED, "split_sms": sms}
        layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, group=group, **kw)
        layer.load_weights(*weights)
        y = cp.empty((t, p.hidden), dtype=cp.uint16)
        graph = capture_layer_call(layer, args, y, stream)
        with stream:
            us = _slowest(group, timer.arm_round(functools.partial(graph.launch, stream=stream)))
        layer.close()
        row = {"split_sms": None if sms is None else list(sms.as_tuple()), "median_us": us}
        rows.append(row)
        say(f"[{n}/{len(candidates)}] {label}: {us:9.1f} us", flush=True)
    fused_us = rows[0]["median_us"]
    split_rows = rows[1:]
    best = min(range(len(split_rows)), key=lambda i: split_rows[i]["median_us"])
    best_sms, best_us = candidates[best], split_rows[best]["median_us"]
    say(f"\n| K1 | K2 | K3 | us | x {YARDSTICK} |\n|---:|---:|---:|---:|---:|")
    for r in split_rows:
        mark = " (best)" if r is split_rows[best] else ""
        say(
            f"| {r['split_sms'][0]} | {r['split_sms'][1]} | {r['split_sms'][2]} | {r['median_us']:.1f}{mark} | "
            f"{r['median_us'] / fused_us:.3f} |"
        )
    say(f"| {YARDSTICK} | | | {fused_us:.1f} | 1.000 |", flush=True)
    result = {
        "preset": name,
        "tokens_per_rank": t,
        "ranks": world,
        "device": info.name,
        "fused_us": fused_us,
        "best": list(best_sms.as_tuple()),
        "rows": rows,
    }
    if rank == 0:
        key = split_tuning.shape_key(info.name, info.sm_count, p.hidden, p.intermediate, experts, p.num_topk, world)
        if store:
            path = split_tuning.store(key, t, best_sms, best_us)
            say(f"stored {best_sms.as_tuple()} for {key} T={t} in {path}")
        if png_path:
            from megamoe_rt.cli.plotting import split_chart

            title = f"tune-split {name} T={t}/rank x{world} on {info.name}"
            split_chart(split_rows, best, fused_us, png_path, title=title, reference_label=YARDSTICK)
            say(f"wrote {png_path} (a bar per K1 | K2 split, the best highlighted; dashed line: {YARDSTICK})")
        if json_path:
            write_json(json_path, result)
    return result


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from megamoe_rt.presets import PRESETS

    ap.add_argument("--preset", default="flash", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=positive_int, required=True, help="tokens per rank")
    ap.add_argument("--ranks", type=positive_int, default=1, help="expert-parallel ranks (one GPU each; default 1)")
    ap.add_argument(
        "--step", type=positive_int, default=None, help="K1 step in SMs (default the partition granularity)"
    )
    add_output_options(ap, "the rows and the best split")
    ap.add_argument(
        "--png", default=None, metavar="FILE", help="write a bar chart of the sweep to this PNG file (matplotlib)"
    )
    ap.add_argument("--no-store", action="store_true", help="do not store the best split in the tuning cache")


def _argv(a: argparse.Namespace) -> list[str]:
    out = ["--preset", a.preset, "--tokens", str(a.tokens), "--ranks", str(a.ranks)]
    for flag, value in (("--step", a.step), ("--output", a.output), ("--png", a.png)):
        if value is not None:
            out += [flag, str(value)]
    return out + (["--json"] if a.json else []) + (["--no-store"] if a.no_store else [])


def check_arguments(a: argparse.Namespace) -> bool:
    """The files it will write (a UsageError naming the option) and matplotlib for ``--png``
    (False after one line saying it is missing): before the GPU probe and any launch."""
    check_output("megamoe-rt tune-split", a)
    check_writable("megamoe-rt tune-split", "--png", a.png)
    if a.png is None:
        return True
    from megamoe_rt.cli.plotting import plotting_or_report

    return plotting_or_report("megamoe-rt tune-split", "--png")


def run(a: argparse.Namespace) -> int:
    """The command for parsed arguments; across ranks it re-runs itself under ``launch``."""
    from megamoe_rt.ep.launch import context_from_env, launch_script, launched

    if not check_arguments(a):
        return 1
    if a.ranks > 1 and not launched():
        return launch_script(a.ranks, "megamoe_rt.cli.tune_split", _argv(a), module=True)
    group = context_from_env() if launched() else None
    from megamoe_rt.requirements import gpu_or_report

    if gpu_or_report("megamoe-rt tune-split", None if group is None else group.device) is None:
        return 1
    with progress_to_stderr(a):
        result = tune_split(
            a.preset, a.tokens, group=group, step=a.step, json_path=a.output, png_path=a.png, store=not a.no_store
        )
    if a.json and (group is None or group.rank == 0):
        print_json(result)
    if group is not None:
        from megamoe_rt.ep.symm import NvshmemRuntime

        NvshmemRuntime.initialize(group).finalize()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="megamoe-rt tune-split", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return exit_status(lambda: run(ap.parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    raise SystemExit(main())
