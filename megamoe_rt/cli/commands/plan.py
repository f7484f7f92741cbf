"""``megamoe-rt plan``: the symmetric buffer's memory report and pool sizes (no GPU needed)."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli.output import add_output_options, check_output, emit
from megamoe_rt.cli.usage import UsageError, mode, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from megamoe_rt.presets import PRESETS

    s = subparsers.add_parser("plan", help="symmetric-buffer memory report and pool sizes (no GPU needed)")
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
    s.set_defaults(func=run)
    return s


def _check_plan_tokens(args: argparse.Namespace, preset: Any, experts: int) -> None:
    """``--tokens`` within what the 32-bit pool row indices (and, for a ``--mode`` that runs the
    fused kernel, its pool blocks) can address, before the planner overflows a counter."""
    from megamoe_rt.kernels.interface.fused import MAX_BLOCKS
    from megamoe_rt.modes.registry import FUSED_KERNEL
    from megamoe_rt.schedule.plan import MAX_POOL_ROWS, max_tokens_per_rank

    max_rows, room = MAX_POOL_ROWS, f"32-bit pool row indices: {MAX_POOL_ROWS:,} rows"
    if args.mode in FUSED_KERNEL:  # they run the fused kernel's block tables
        blocks = int(MAX_BLOCKS.value)
        max_rows, room = min(max_rows, blocks * args.block_m), f"the fused kernel's {blocks:,} pool blocks"
    limit = max_tokens_per_rank(args.ranks, preset.num_topk, experts // args.ranks, args.block_m, max_rows)
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


def run(args: argparse.Namespace) -> int:
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
