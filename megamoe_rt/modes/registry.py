"""Execution modes by name, and how a layer picks one.

Every mode name is spelled here (and in its class's ``name``); the layer, the command line and
the benchmarks take names, choices and defaults from this module. Importing it imports no mode:
the classes (and the kernels behind them) load on the first lookup in :data:`MODES`, so the
command line builds its options from the names alone.

A new mode is a :class:`~megamoe_rt.modes.base.Mode` subclass, its name in :data:`NAMES` and its
class in ``_classes`` (and in :data:`DEFAULT_ORDER` if it should ever be picked without being
asked for, :data:`FUSED_KERNEL` if it runs the fused kernel, :data:`SM_PARTITIONED` if it runs
on SM partitions).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megamoe_rt.modes.base import LayerSpec, Mode

# Every mode, in the order the command line lists them.
NAMES: tuple[str, ...] = ("unfused", "fused", "split")

# mode=None: the first of these that can run the shape. Fused is faster on every benchmarked
# shape, on one GPU and across two (bench/results/moe_fused_vs_unfused_h200_2026-11-30.md,
# bench/results/ep2_h200_2026-11-30.md); unfused runs every shape. Split is asked for by name:
# it holds green contexts and SM partitions, an experiment's choice rather than a default.
DEFAULT_ORDER: tuple[str, ...] = ("fused", "unfused")

# The modes that run the fused kernel (split: in its K1 and K2 roles, beside the K3 reduce): the
# kernel's pool blocks bound their calls, and their blocks stamp per-block stage traces
# (megamoe_rt.testing.trace_buffer, ``megamoe-rt trace``).
FUSED_KERNEL: tuple[str, ...] = ("fused", "split")

# The modes whose persistent kernel consumes the input ring itself (a streamed call's L1 starts
# on pool blocks as they complete), on one rank.
KERNEL_STREAMING: tuple[str, ...] = ("fused",)

# The modes that run on green-context SM partitions: they take ``split_sms`` (K1, K2, K3), and
# their trace rows are split by kernel.
SM_PARTITIONED: tuple[str, ...] = ("split",)


def mode_names() -> tuple[str, ...]:
    return NAMES


def default_mode(among: tuple[str, ...] | None = None) -> str:
    """The first mode of :data:`DEFAULT_ORDER` (of those in ``among``, if given): what a layer
    runs where the shape allows, and what a command runs unless told otherwise."""
    candidates = NAMES if among is None else among
    return next((name for name in DEFAULT_ORDER if name in candidates), candidates[0])


def baseline_mode() -> str:
    """The mode that runs every shape (the last default candidate): the benchmarks' default arm,
    and what the other modes are read against."""
    return DEFAULT_ORDER[-1]


@functools.cache
def _classes() -> dict[str, type[Mode]]:
    from megamoe_rt.modes.fused import FusedMode
    from megamoe_rt.modes.split import SplitMode
    from megamoe_rt.modes.unfused import UnfusedMode

    return {cls.name: cls for cls in (UnfusedMode, FusedMode, SplitMode)}


class _Modes(Mapping[str, "type[Mode]"]):
    """Name -> mode class, in :data:`NAMES` order; the classes are imported on the first lookup."""

    def __getitem__(self, name: str) -> type[Mode]:
        return _classes()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)

    def __contains__(self, name: object) -> bool:  # a name check imports no mode
        return name in NAMES

    def __repr__(self) -> str:
        return f"MODES({', '.join(NAMES)})"


MODES: Mapping[str, type[Mode]] = _Modes()


def select_mode(
    mode: str | None,
    spec: LayerSpec,
    *,
    ring_blocks: int | None = None,
    split_sms: object = None,
    chunk_ratio: object = None,
) -> type[Mode]:
    """The mode class a layer of ``spec`` runs, checking the mode arguments the way the layer's
    constructor reports them (ValueError)."""
    if mode is None:
        streamed = spec.streaming is not None
        runnable = [
            MODES[name]
            for name in DEFAULT_ORDER
            if MODES[name].refusal(spec) is None
            and (not streamed or MODES[name].streams_by_default)
            and (not streamed or MODES[name].streams_over_ring or (ring_blocks is None and chunk_ratio is None))
        ]
        if not runnable:
            reasons = "; ".join(str(MODES[name].refusal(spec)) for name in DEFAULT_ORDER)
            raise ValueError(f"no mode runs this layer: {reasons}")
        cls = runnable[0]
    else:
        found = MODES.get(mode) if isinstance(mode, str) else None
        if found is None:
            raise ValueError(f"mode: expected one of {mode_names()} or None, got {mode!r}")
        cls = found
        reason = cls.refusal(spec)
        if reason is not None:
            raise ValueError(reason)
    if spec.streaming is not None and not cls.streams_over_ring:
        for option, value in (("ring_blocks", ring_blocks), ("chunk_ratio", chunk_ratio)):
            if value is not None:
                raise ValueError(
                    f"{option}={value!r}: a streamed layer in mode={cls.name!r} holds the full pool; "
                    "mode='unfused' streams over a ring"
                )
    if split_sms is not None and cls.name not in SM_PARTITIONED:
        takes = " or ".join(f"mode={name!r}" for name in SM_PARTITIONED)
        raise ValueError(f"split_sms={split_sms!r}: only {takes} takes SM counts")
    if chunk_ratio is not None and ring_blocks is not None:
        raise ValueError(f"ring_blocks={ring_blocks!r}, chunk_ratio={chunk_ratio!r}: pass one of them")
    return cls
