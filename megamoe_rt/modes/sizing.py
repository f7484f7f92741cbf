"""The buffer a layer allocates, from its spec and mode arguments.

:class:`~megamoe_rt.layer.MegaMoE` and ``megamoe-rt plan`` both size the buffer here, so the
plan a user reads before allocating is the allocation (``tests/cpu/test_plan_sizing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from megamoe_rt.modes.base import POOL_REGIONS, LayerSpec, LayoutNeeds, Mode, buffer_layout
from megamoe_rt.schedule.layout import BufferLayout
from megamoe_rt.schedule.ring_size import PoolCost, ring_blocks_for_memory, ring_blocks_for_ratio
from megamoe_rt.schedule.token_windows import num_windows


def full_pool_layout(mode_cls: type[Mode], spec: LayerSpec) -> BufferLayout:
    """The buffer with the mode's whole worst-case pool: what a ring is measured against."""
    needs = mode_cls.layout_needs(spec)
    return buffer_layout(spec, LayoutNeeds(pool="full", block_m=needs.block_m))


def ring_for_chunk_ratio(
    mode_cls: type[Mode], spec: LayerSpec, chunk_ratio: float | str, free_bytes: Callable[[], int]
) -> int:
    """Ring blocks for ``chunk_ratio``: a share of the worst-case pool, or ``"auto"``, what fits
    the memory budget of ``free_bytes()`` (called only then; megamoe_rt/schedule/ring_size.py)."""
    full = full_pool_layout(mode_cls, spec)
    minimum = mode_cls.minimum_ring_blocks(spec)
    if chunk_ratio != "auto":
        return ring_blocks_for_ratio(full.pool_blocks, float(chunk_ratio), minimum)
    pools = sum(full.region(n).nbytes for n in POOL_REGIONS)
    per_block = pools // max(full.pool_blocks, 1)
    cost = PoolCost(per_block, full.total_bytes - pools, full.pool_blocks)
    return ring_blocks_for_memory(cost, free_bytes(), minimum)


def layer_layout(
    mode_cls: type[Mode],
    spec: LayerSpec,
    *,
    ring_blocks: int | None = None,
    chunk_ratio: float | str | None = None,
    free_bytes: Callable[[], int] | None = None,
) -> BufferLayout:
    """The layout of the buffer a layer of ``spec`` in ``mode_cls`` allocates, with the mode's
    pool (``ring_blocks`` or ``chunk_ratio``, at most one, checked by ``select_mode``), the
    streaming ring and the staging regions the spec asks for. ``free_bytes`` is needed only for
    ``chunk_ratio="auto"``."""
    if chunk_ratio is not None:
        if chunk_ratio == "auto" and free_bytes is None:
            raise ValueError("chunk_ratio='auto': sizing the ring needs the device memory free (free_bytes)")
        ring_blocks = ring_for_chunk_ratio(mode_cls, spec, chunk_ratio, free_bytes or (lambda: 0))
    return buffer_layout(spec, mode_cls.layout_needs(spec, ring_blocks))


def token_window_note(runner: Mode, capacity: int, window: int) -> str:
    """The memory report's line on token windows: the buffer of a layer whose mode object is
    ``runner`` against the one a layer without a window would allocate (the mode's default
    pool at the full ``capacity``)."""
    line = (
        f"token window: {window} tokens per rank (a call of up to {capacity} tokens runs as up to "
        f"{num_windows(capacity, window)} windows); buffer {runner.layout.total_bytes / 2**20:.2f} MiB"
    )
    try:
        whole = layer_layout(type(runner), replace(runner.spec, num_max_tokens_per_rank=capacity))
    except ValueError as exc:  # a capacity the mode cannot hold in one window at all
        return f"{line}; without a window: not possible ({exc})"
    return f"{line} vs {whole.total_bytes / 2**20:.2f} MiB without a window"
