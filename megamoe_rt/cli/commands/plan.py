"""``megamoe-rt plan``: the symmetric buffer's memory report and pool sizes (no GPU needed)."""

from __future__ import annotations

import argparse
from typing import Any

from megamoe_rt.cli.output import add_output_options, check_output, emit
from megamoe_rt.cli.usage import UsageError, chunk_ratio, mode, positive_int, positive_number, stream_config


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
    s.add_argument("--pool", choices=("full", "ring"), default="full", help="without a layer option below")
    s.add_argument("--block-m", type=int, choices=(64, 128), default=128, help="without a layer option below")
    s.add_argument("--act-sf-gran", type=int, choices=(64, 128), default=128)
    # The layer's options: with any of them (or --mode) the plan is the buffer MegaMoE allocates.
    s.add_argument("--ring-blocks", type=positive_int, default=None, help="the layer's ring_blocks")
    s.add_argument(
        "--chunk-ratio",
        type=chunk_ratio,
        default=None,
        help="the layer's chunk_ratio: a share in (0, 1] of the worst-case pool, or 'auto' (needs --free-gib)",
    )
    s.add_argument("--free-gib", type=positive_number, default=None, help="device memory free, for --chunk-ratio auto")
    s.add_argument(
        "--stream",
        type=stream_config,
        default=None,
        metavar="SLOTSxTOKENS",
        help="the layer's streaming=StreamConfig(SLOTS, TOKENS) input ring, e.g. 4x512",
    )
    s.add_argument(
        "--token-window",
        type=positive_int,
        default=None,
        help="the layer's token_window: the buffer for this many tokens, longer calls in windows",
    )
    s.add_argument(
        "--transport",
        choices=("nvlink", "nvshmem"),
        default=None,
        help="across ranks: how the layer reaches its peers (nvshmem adds staging regions)",
    )
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
    window = args.token_window
    if window is not None and min(args.tokens, window) > limit:
        raise UsageError(
            f"megamoe-rt plan: --token-window {window}: {shape} takes at most {limit} tokens per rank in a "
            f"window (its worst-case pool must fit {room})"
        )
    if window is None and args.tokens > limit:
        raise UsageError(
            f"megamoe-rt plan: --tokens {args.tokens}: {shape} takes at most {limit} tokens per rank "
            f"(its worst-case pool must fit {room}; --token-window runs longer calls in windows)"
        )


def run(args: argparse.Namespace) -> int:
    check_output("megamoe-rt plan", args)
    from megamoe_rt.presets import get_preset
    from megamoe_rt.schedule.layout import symm_buffer_layout
    from megamoe_rt.schedule.plan import fused_schedule
    from megamoe_rt.schedule.token_windows import num_windows

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
    layer_options = (args.ring_blocks, args.chunk_ratio, args.stream, args.transport, args.token_window)
    full = None
    if args.mode is not None or any(o is not None for o in layer_options):
        mode_cls, spec = _layer_spec(args, preset, experts)
        args.mode, args.block_m = mode_cls.name, mode_cls.layout_needs(spec).block_m
    _check_plan_tokens(args, preset, experts)
    try:
        if args.mode is not None:  # the buffer a MegaMoE of these options allocates
            layout = _layer_layout(args, mode_cls, spec)
            full = _whole_call_full_pool(mode_cls, spec, args.tokens)
        else:
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
        sched = fused_schedule(layout.num_max_tokens_per_rank, ranks, preset.num_topk, experts, block_m=layout.block_m)
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
            **_layer_fields(args, full),
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
    if args.token_window is not None and args.token_window < args.tokens:
        print(
            f"token window: {layout.num_max_tokens_per_rank} tokens per rank; a call of {args.tokens} tokens runs as "
            f"{num_windows(args.tokens, args.token_window)} windows"
        )
    if args.mode is not None:
        mib = layout.total_bytes / 2**20
        if full is None:
            print(
                f"mode {args.mode}: buffer {mib:.2f} MiB; the full worst-case pool of {args.tokens} tokens does not fit"
            )
        else:
            print(
                f"mode {args.mode}: buffer {mib:.2f} MiB vs {full.total_bytes / 2**20:.2f} MiB with the full "
                f"worst-case pool of {args.tokens} tokens and no window ({layout.total_bytes / full.total_bytes:.3f}x)"
            )
    return 0


def _whole_call_full_pool(mode_cls: Any, spec: Any, tokens: int) -> Any:
    """The buffer with the mode's full worst-case pool for the whole call at once (no ring, no
    window): what the plan is read against; None where it cannot be built (too many pool rows)."""
    from dataclasses import replace

    from megamoe_rt.modes.sizing import full_pool_layout

    try:
        return full_pool_layout(mode_cls, replace(spec, num_max_tokens_per_rank=tokens))
    except (ValueError, OverflowError):
        return None


def _layer_spec(args: argparse.Namespace, preset: Any, experts: int) -> tuple[Any, Any]:
    """The mode class and :class:`LayerSpec` a MegaMoE built with these options would have
    (the layer's own checks, said in the options typed)."""
    from megamoe_rt.modes.base import LayerSpec
    from megamoe_rt.modes.registry import select_mode

    if args.transport == "nvshmem" and args.ranks == 1:
        raise UsageError("megamoe-rt plan: --transport nvshmem needs --ranks of 2 or more (one rank reaches no peer)")
    if args.stream is not None and args.stream.tokens_per_slot > args.tokens:
        raise UsageError(
            f"megamoe-rt plan: --stream {args.stream.num_slots}x{args.stream.tokens_per_slot}: a slot holds more "
            f"than --tokens {args.tokens}"
        )
    if args.chunk_ratio == "auto" and args.free_gib is None:
        raise UsageError("megamoe-rt plan: --chunk-ratio auto sizes the ring by the memory free: give --free-gib")
    if args.token_window is not None and args.stream is not None:
        raise UsageError("megamoe-rt plan: --token-window and --stream: a streamed layer's calls are sized by its ring")
    spec = LayerSpec(
        preset.hidden,
        preset.intermediate,
        experts,
        preset.num_topk,
        args.tokens if args.token_window is None else min(args.tokens, args.token_window),
        num_ranks=args.ranks,
        act_sf_gran=args.act_sf_gran,
        streaming=args.stream,
        transport=args.transport or "nvlink",
    )
    try:
        mode_cls = select_mode(args.mode, spec, ring_blocks=args.ring_blocks, chunk_ratio=args.chunk_ratio)
    except ValueError as exc:
        raise UsageError(f"megamoe-rt plan: {_in_option_names(str(exc))}") from None
    return mode_cls, spec


def _layer_layout(args: argparse.Namespace, mode_cls: Any, spec: Any) -> Any:
    """The layer's buffer (megamoe_rt.modes.sizing.layer_layout), with the mode's own check of
    the ring it is given."""
    from megamoe_rt.modes.sizing import layer_layout

    free_gib = args.free_gib
    layout = layer_layout(
        mode_cls,
        spec,
        ring_blocks=args.ring_blocks,
        chunk_ratio=args.chunk_ratio,
        free_bytes=None if free_gib is None else (lambda: int(free_gib * 2**30)),
    )
    try:
        mode_cls(spec, layout)  # host-only: a ring below what the mode runs on is refused here
    except ValueError as exc:
        raise UsageError(f"megamoe-rt plan: {_in_option_names(str(exc))}") from None
    return layout


def _in_option_names(message: str) -> str:
    """A layer error in the command's terms (``ring_blocks=`` is ``--ring-blocks``)."""
    for name in ("ring_blocks", "chunk_ratio", "streaming", "transport", "mode"):
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ").replace(f"{name}:", f"--{name}:")
    return message.replace("--streaming", "--stream")


def _layer_fields(args: argparse.Namespace, full: Any) -> dict[str, Any]:
    if args.mode is None:
        return {}
    return {
        "mode": args.mode,
        "token_window": args.token_window,
        "full_pool_blocks": None if full is None else full.pool_blocks,
        "full_pool_total_bytes": None if full is None else full.total_bytes,
    }
