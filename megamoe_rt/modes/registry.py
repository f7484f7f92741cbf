"""Execution modes by name, and how a layer picks one.

A new mode is a :class:`~megamoe_rt.modes.base.Mode` subclass plus one entry in :data:`MODES`
(and in :data:`DEFAULT_ORDER` if it should ever be picked without being asked for).
"""

from __future__ import annotations

from megamoe_rt.modes.base import LayerSpec, Mode
from megamoe_rt.modes.fused import FusedMode
from megamoe_rt.modes.split import SplitMode
from megamoe_rt.modes.unfused import UnfusedMode

MODES: dict[str, type[Mode]] = {"unfused": UnfusedMode, "fused": FusedMode, "split": SplitMode}

# mode=None: the first of these that can run the shape. Fused is faster on every benchmarked
# shape, on one GPU and across two (bench/results/moe_fused_vs_unfused_h200_2026-11-30.md,
# bench/results/ep2_h200_2026-11-30.md); unfused runs every shape. Split is asked for by name:
# it holds green contexts and SM partitions, an experiment's choice rather than a default.
DEFAULT_ORDER: tuple[str, ...] = ("fused", "unfused")


def mode_names() -> tuple[str, ...]:
    return tuple(MODES)


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
        runnable = [MODES[name] for name in DEFAULT_ORDER if MODES[name].refusal(spec) is None]
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
    if split_sms is not None and cls.name != "split":
        raise ValueError(f"split_sms={split_sms!r}: only mode='split' takes SM counts")
    if chunk_ratio is not None and ring_blocks is not None:
        raise ValueError(f"ring_blocks={ring_blocks!r}, chunk_ratio={chunk_ratio!r}: pass one of them")
    return cls
