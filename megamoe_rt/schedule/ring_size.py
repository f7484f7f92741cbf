"""How many ring slots a layer's pools get from ``chunk_ratio`` (no GPU).

The worst-case pool (every token of every rank routed here) is what a buffer without a ring
reserves; long prefill makes it the largest part of the buffer. A ring of fewer blocks holds
the same rows in turns. ``chunk_ratio`` picks the ring as a share of the worst-case pool, or,
with ``"auto"``, the whole pool when the buffer then fits the memory budget and else the
largest ring that does (never below the mode's own minimum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# "auto" lets the buffer take at most this share of the device memory free at construction.
AUTO_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class PoolCost:
    """Bytes of a buffer: the part that scales with the pool's blocks, and the rest."""

    bytes_per_block: int
    fixed_bytes: int
    full_pool_blocks: int

    def total(self, blocks: int) -> int:
        return self.fixed_bytes + blocks * self.bytes_per_block


def check_chunk_ratio(chunk_ratio: object) -> float | str:
    if chunk_ratio == "auto":
        return "auto"
    if isinstance(chunk_ratio, bool) or not isinstance(chunk_ratio, (int, float)):
        raise TypeError(f"chunk_ratio: expected a number in (0, 1] or 'auto', got {chunk_ratio!r}")
    ratio = float(chunk_ratio)
    if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
        raise ValueError(f"chunk_ratio: expected a number in (0, 1] or 'auto', got {chunk_ratio!r}")
    return ratio


def ring_blocks_for_ratio(full_pool_blocks: int, ratio: float, minimum_blocks: int = 1) -> int:
    """``ceil(ratio x full pool)`` blocks, at least ``minimum_blocks``, at most the full pool."""
    want = math.ceil(ratio * full_pool_blocks)
    return max(1, min(full_pool_blocks, max(minimum_blocks, want)))


def ring_blocks_for_memory(cost: PoolCost, free_bytes: int, minimum_blocks: int) -> int:
    """The whole pool if the buffer fits ``AUTO_MEMORY_SHARE`` of ``free_bytes``; else the
    largest ring that fits, and never fewer than ``minimum_blocks`` (the allocation then
    reports the shortfall itself)."""
    budget = int(AUTO_MEMORY_SHARE * free_bytes)
    full = cost.full_pool_blocks
    if cost.total(full) <= budget:
        return full
    fits = (budget - cost.fixed_bytes) // cost.bytes_per_block if cost.bytes_per_block else full
    return max(1, min(full, max(minimum_blocks, fits)))
