"""Test and profiling hooks on a :class:`~megamoe_rt.layer.MegaMoE`, kept out of the production
classes.

The fused mode exposes one seam, ``FusedMode.params_transforms``: callables applied in order
to each launch's parameter struct before it is enqueued (empty in production). The context
managers here add a transform for the calls made inside them and remove it on exit; they
compose. A call captured into a CUDA graph keeps the parameters it was captured with.

    with withhold_block(layer, 0):          # a launch that never publishes block 0's rows
        layer(x, x_sf, topk_idx, topk_weights)
    with trace_buffer(layer) as stamps:     # per-block event stamps of one fused call
        layer(x, x_sf, topk_idx, topk_weights, stream=s)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megamoe_rt.kernels import fused as fk
from megamoe_rt.modes.fused import CallSchedule, FusedMode, ParamsTransform
from megamoe_rt.schedule.plan import FusedSchedule

__all__ = [
    "force_call_schedule",
    "fused_runner",
    "fused_schedule_of",
    "params_transform",
    "trace_buffer",
    "trace_into",
    "withhold_block",
]


def fused_runner(layer: Any) -> FusedMode:
    """The fused mode object of ``layer`` (TypeError for a layer of another mode)."""
    runner = getattr(layer, "runner", layer)
    if not isinstance(runner, FusedMode):
        raise TypeError(f"expected a layer of mode {FusedMode.name!r}, got mode {getattr(runner, 'name', runner)!r}")
    return runner


def fused_schedule_of(layer: Any) -> FusedSchedule:
    """The schedule a fused layer's buffer was sized for (lag and ring at its capacity, the
    worst-case pool in ``full_pool_blocks``)."""
    return fused_runner(layer).schedules.buffer


@contextmanager
def params_transform(layer: Any, transform: ParamsTransform) -> Iterator[None]:
    """Apply ``transform`` to the parameter struct of every fused launch made inside the block."""
    runner = fused_runner(layer)
    runner.params_transforms = (*runner.params_transforms, transform)
    try:
        yield
    finally:
        kept = list(runner.params_transforms)
        kept.remove(transform)  # by identity of the entry added above
        runner.params_transforms = tuple(kept)


def withhold_block(layer: Any, block: int | None) -> Any:
    """Launches that never publish the arrival of pool block ``block``'s rows, so whoever waits
    on it times out (None or ``kernels.fused.NO_BLOCK``: withhold nothing)."""
    value = fk.NO_BLOCK if block is None else int(block)

    def withhold(params: fk.FusedParams) -> None:
        params.withhold_block = value

    return params_transform(layer, withhold)


def force_call_schedule(layer: Any, schedule: CallSchedule) -> Any:
    """Launches in ``schedule``'s order whatever their ``num_tokens_bound`` (e.g. a single wave
    larger than the ring, which the kernel must refuse)."""
    lag, group = int(schedule.lag_units), int(schedule.group_units)

    def force(params: fk.FusedParams) -> None:
        params.lag_units = lag
        params.group_units = group

    return params_transform(layer, force)


def trace_into(layer: Any, trace_ptr: int) -> Any:
    """Launches that stamp ``kernels.fused.TRACE_EVENTS`` per block into the device array at
    ``trace_ptr`` (uint64 ``[grid blocks, len(TRACE_EVENTS)]``, globaltimer ns but the last
    column, the block's SM). A split layer's K1 blocks take the first rows, K2's the next."""
    ptr = int(trace_ptr)

    def trace(params: fk.FusedParams) -> None:
        params.trace = ptr

    return params_transform(layer, trace)


@contextmanager
def trace_buffer(layer: Any) -> Iterator[Any]:
    """A zeroed CuPy uint64 ``[rows, len(TRACE_EVENTS)]`` array the fused calls inside the block
    stamp: one row per block of the persistent grid (split: K1's blocks, then K2's, then K3's,
    whose rows hold start, combine_done and sm only; rows of K3 blocks that did not run stay 0)."""
    import cupy as cp

    runner = fused_runner(layer)
    spec = runner.spec
    with cp.cuda.Device(spec.device):
        stamps = cp.zeros((runner.trace_rows(), len(fk.TRACE_EVENTS)), cp.uint64)
        # The zeros are written on CuPy's current stream, the call runs on the caller's.
        cp.cuda.Device(spec.device).synchronize()
    with trace_into(layer, int(stamps.data.ptr)):
        yield stamps
