"""Scheduling arithmetic shared by the host runtime, the buffer layout and tests.

Everything that decides how many pool blocks, ring slots, schedule units or
prefill cycles a call needs lives here, so the buffer layout, the kernel
launch parameters and the tests can never disagree about it.

Terms:

* pool: one rank's buffer of received rows, grouped by local expert, each
  expert's rows padded up to a multiple of ``block_m`` (one GEMM m-block).
* unit: up to ``UNIT_BLOCKS`` consecutive m-blocks of one expert; the fused
  kernel's task order is built from units.
* lag: the L2 (down-projection) tasks of a block are issued ``lag`` units after
  its L1 (gate/up) tasks, in groups of ``LAG_GROUP_UNITS`` units, so the L1
  output a block needs is normally finished by the time its L2 task starts.
* ring: a pool that only holds the blocks live in that lag window (plus a
  margin) instead of the whole worst-case pool, reused cyclically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megamoe_rt.runtime import args
from megamoe_rt.schedule.arith import align_up, ceil_div

__all__ = [
    "BLOCK_M_CHOICES",
    "LAG_GROUP_UNITS",
    "LAG_MAX_UNITS",
    "LAG_MIN_UNITS",
    "MAX_POOL_ROWS",
    "RING_MARGIN_BLOCKS",
    "TOKEN_ALIGN",
    "UNIT_BLOCKS",
    "FusedSchedule",
    "align_tokens",
    "check_expert_split",
    "checked_pool_blocks",
    "estimated_units",
    "fused_schedule",
    "lag_units",
    "live_blocks_upper_bound",
    "max_tokens_per_rank",
    "num_cycles",
    "num_cycles_across_ranks",
    "pool_blocks_upper_bound",
    "single_wave_fits",
]

# Token capacity granularity: one full m-block of the dispatch/combine
# kernels, and it keeps every [.., T] scale-factor row 512-byte aligned.
TOKEN_ALIGN = 128

UNIT_BLOCKS = 8
LAG_GROUP_UNITS = 4
# Slack so a producer landing the next group never has to wait on the very
# last live block being released.
RING_MARGIN_BLOCKS = 4

# Below 8 units the L1 results are not ready in time; beyond 64 the ring (and
# the tail where only L2 work remains) grows without hiding more latency.
LAG_MIN_UNITS = 8
LAG_MAX_UNITS = 64
# lag = round_half_up(0.45 * units), kept as an integer ratio so the result
# never depends on binary floating point.
_LAG_NUM = 45
_LAG_DEN = 100

BLOCK_M_CHOICES = (64, 128)  # rows of a pool block


# --------------------------------------------------------------------------
# the layer's shape: the one check of what the layout, the planner and the layer need
# --------------------------------------------------------------------------

# Pool rows are addressed by signed 32-bit row indices (expert offsets, send lists, the
# per-row metadata's sources), so a worst-case pool holds at most this many rows.
MAX_POOL_ROWS = 2**31 - 1


def check_expert_split(num_experts: object, num_topk: object, num_ranks: object) -> tuple[int, int, int]:
    """``(num_experts, num_topk, num_ranks)`` as ints (runtime/args.py), the experts split evenly
    over the ranks and a token's ``num_topk`` experts distinct ones.

    The one check of these facts: the buffer layout, the fused planner and the layer call it,
    so each refusal has one message wherever it is found."""
    e = args.integer("num_experts", num_experts, minimum=1)
    k = args.integer("num_topk", num_topk, minimum=1)
    r = args.integer("num_ranks", num_ranks, minimum=1)
    if e % r:
        raise ValueError(f"num_experts={e}: expected a multiple of num_ranks={r}")
    if k > e:
        raise ValueError(f"num_topk={k}: expected at most num_experts={e}")
    return e, k, r


# --------------------------------------------------------------------------
# capacities
# --------------------------------------------------------------------------


def align_tokens(n: int) -> int:
    """Round a token count up to the buffer's capacity granularity (128)."""
    n = args.integer("n", n, minimum=0)
    return align_up(n, TOKEN_ALIGN)


def pool_blocks_upper_bound(
    num_tokens_per_rank: int,
    num_ranks: int,
    num_topk: int,
    num_local_experts: int,
    block_m: int,
) -> int:
    """Worst-case number of ``block_m``-row blocks in one rank's expert pool.

    Each received (token, local expert) pair takes one pool row, and a token
    can reach at most ``min(num_topk, num_local_experts)`` experts of a single
    rank, so at most ``N = num_ranks * num_tokens_per_rank * that`` rows
    arrive. Padding each expert up to ``block_m`` wastes at most
    ``block_m - 1`` rows per expert, hence
    ``sum_e ceil(n_e / bm) <= floor((N + E_local * (bm - 1)) / bm)``.
    When no rows can arrive no expert needs a block at all.
    """
    t = args.integer("num_tokens_per_rank", num_tokens_per_rank, minimum=0)
    r = args.integer("num_ranks", num_ranks, minimum=1)
    k = args.integer("num_topk", num_topk, minimum=1)
    e = args.integer("num_local_experts", num_local_experts, minimum=1)
    bm = args.integer("block_m", block_m, minimum=1)
    rows = r * t * min(k, e)
    if rows == 0:
        return 0
    return (rows + e * (bm - 1)) // bm


def max_tokens_per_rank(
    num_ranks: int, num_topk: int, num_local_experts: int, block_m: int, max_rows: int = MAX_POOL_ROWS
) -> int:
    """The most tokens per rank (a multiple of :data:`TOKEN_ALIGN`) whose worst-case pool holds
    at most ``max_rows`` rows; 0 when not even ``TOKEN_ALIGN`` tokens fit."""
    r = args.integer("num_ranks", num_ranks, minimum=1)
    k = args.integer("num_topk", num_topk, minimum=1)
    el = args.integer("num_local_experts", num_local_experts, minimum=1)
    bm = args.integer("block_m", block_m, minimum=1)
    cap = args.integer("max_rows", max_rows, minimum=0)

    def fits(units: int) -> bool:
        return pool_blocks_upper_bound(units * TOKEN_ALIGN, r, k, el, bm) * bm <= cap

    lo, hi = 0, cap // TOKEN_ALIGN + 1  # a pool row per token at least: hi never fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * TOKEN_ALIGN


def checked_pool_blocks(
    num_tokens_per_rank: int, num_ranks: int, num_topk: int, num_local_experts: int, block_m: int
) -> int:
    """:func:`pool_blocks_upper_bound`, refused (ValueError) when the worst-case pool's rows
    exceed what 32-bit pool row indices address (:data:`MAX_POOL_ROWS`).

    The one check of the pool-row limit: the buffer layout and the fused planner call it, with
    the same message (the tokens per rank that do fit included)."""
    blocks = pool_blocks_upper_bound(num_tokens_per_rank, num_ranks, num_topk, num_local_experts, block_m)
    rows = blocks * block_m
    if rows > MAX_POOL_ROWS:
        limit = max_tokens_per_rank(num_ranks, num_topk, num_local_experts, block_m)
        raise ValueError(
            f"tokens per rank {num_tokens_per_rank}: expected at most {limit} with num_ranks={num_ranks}, "
            f"num_topk={num_topk}, num_local_experts={num_local_experts}, block_m={block_m} "
            f"(the worst-case pool takes {rows} rows; 32-bit pool row indices address {MAX_POOL_ROWS})"
        )
    return blocks


# --------------------------------------------------------------------------
# fused lag-ordered schedule
# --------------------------------------------------------------------------


def estimated_units(
    num_tokens_bound: int,
    num_ranks: int,
    num_topk: int,
    num_experts: int,
    num_local_experts: int,
    block_m: int,
) -> int:
    """Units one rank's task order holds when routing is uniform.

    The lag is sized for the typical call, not the worst case: a skewed call
    only makes some L2 tasks wait, it never breaks correctness.
    """
    t = args.integer("num_tokens_bound", num_tokens_bound, minimum=0)
    r = args.integer("num_ranks", num_ranks, minimum=1)
    k = args.integer("num_topk", num_topk, minimum=1)
    e = args.integer("num_experts", num_experts, minimum=1)
    el = args.integer("num_local_experts", num_local_experts, minimum=1)
    bm = args.integer("block_m", block_m, minimum=1)
    tokens_per_expert = ceil_div(r * t * k, e)
    blocks_per_expert = ceil_div(tokens_per_expert, bm)
    return el * ceil_div(blocks_per_expert, UNIT_BLOCKS)


def lag_units(units: int) -> int:
    """``clamp(round_half_up(0.45 * units), 8, 64)``."""
    u = args.integer("units", units, minimum=0)
    lag = (_LAG_NUM * u + _LAG_DEN // 2) // _LAG_DEN
    return max(LAG_MIN_UNITS, min(LAG_MAX_UNITS, lag))


@dataclass(frozen=True)
class FusedSchedule:
    """Lag and ring sizing of the fused L1/L2 task order for one token bound.

    ``ring_blocks`` never exceeds ``full_pool_blocks``; when it equals it, the
    ring is simply the whole worst-case pool and never wraps.
    """

    lag_units: int
    group_units: int
    ring_blocks: int
    full_pool_blocks: int

    def __post_init__(self) -> None:
        for name in ("lag_units", "group_units", "ring_blocks", "full_pool_blocks"):
            args.integer(name, getattr(self, name), minimum=0)
        if self.ring_blocks > self.full_pool_blocks:
            raise ValueError(
                f"ring_blocks={self.ring_blocks}: expected at most full_pool_blocks={self.full_pool_blocks}"
            )
        # A wrapping ring smaller than the live window would let a producer
        # overwrite a block whose L2 task has not consumed it yet.
        live = live_blocks_upper_bound(self)
        if not self.covers_full_pool and self.ring_blocks < live:
            raise ValueError(
                f"ring_blocks={self.ring_blocks}: expected at least the live "
                f"window of {live} blocks (or the full pool of "
                f"{self.full_pool_blocks} blocks)"
            )

    @property
    def covers_full_pool(self) -> bool:
        return self.ring_blocks >= self.full_pool_blocks


def live_blocks_upper_bound(schedule: FusedSchedule) -> int:
    """Blocks that can be filled but not yet released at any instant.

    L2 of a block trails its L1 by ``lag`` units and is issued a whole group
    at a time, so at most ``lag + group`` units of blocks are in flight.
    """
    return UNIT_BLOCKS * (schedule.lag_units + schedule.group_units)


def fused_schedule(
    num_tokens_bound: int,
    num_ranks: int,
    num_topk: int,
    num_experts: int,
    block_m: int = 128,
) -> FusedSchedule:
    """Lag, group and ring size for calls of at most ``num_tokens_bound`` tokens per rank."""
    t = args.integer("num_tokens_bound", num_tokens_bound, minimum=1)
    e, k, r = check_expert_split(num_experts, num_topk, num_ranks)
    bm = args.integer_choice("block_m", block_m, BLOCK_M_CHOICES)
    el = e // r
    full = checked_pool_blocks(t, r, k, el, bm)
    lag = lag_units(estimated_units(t, r, k, e, el, bm))
    group = LAG_GROUP_UNITS
    ring = min(UNIT_BLOCKS * (lag + group) + RING_MARGIN_BLOCKS, full)
    return FusedSchedule(lag_units=lag, group_units=group, ring_blocks=ring, full_pool_blocks=full)


def single_wave_fits(
    num_tokens_bound: int,
    num_ranks: int,
    num_topk: int,
    num_experts: int,
    ring_blocks: int,
    block_m: int = 128,
) -> bool:
    """True when even the worst-case pool of a call at this bound fits the ring.

    Such calls can take the simple single-wave order (all L1, then all L2)
    because no ring slot is ever reused within the call.
    """
    t = args.integer("num_tokens_bound", num_tokens_bound, minimum=0)
    e, k, r = check_expert_split(num_experts, num_topk, num_ranks)
    ring = args.integer("ring_blocks", ring_blocks, minimum=0)
    bm = args.integer_choice("block_m", block_m, BLOCK_M_CHOICES)
    return pool_blocks_upper_bound(t, r, k, e // r, bm) <= ring


# --------------------------------------------------------------------------
# prefill cycles
# --------------------------------------------------------------------------


def num_cycles(total_pool_blocks: int, ring_blocks: int) -> int:
    """Passes over the ring needed to stream ``total_pool_blocks`` blocks.

    An empty pool still takes one cycle, because every rank must join the
    cross-rank barriers of at least one pass.
    """
    total = args.integer("total_pool_blocks", total_pool_blocks, minimum=0)
    ring = args.integer("ring_blocks", ring_blocks, minimum=1)
    return max(1, ceil_div(total, ring))


def cycles_to_launch(
    num_tokens_bound: int, num_ranks: int, num_topk: int, num_local_experts: int, ring_blocks: int, block_m: int
) -> int:
    """Cycles the host enqueues for a call bounded by ``num_tokens_bound`` tokens per rank: enough
    for the worst-case pool at that bound, so every rank enqueues the same number (the bound is
    the same on every rank) and no routing can need more. A rank whose pool ends sooner runs
    its last cycles empty."""
    t = args.integer("num_tokens_bound", num_tokens_bound, minimum=0)
    worst = pool_blocks_upper_bound(t, num_ranks, num_topk, num_local_experts, block_m)
    return num_cycles(worst, ring_blocks)


def num_cycles_across_ranks(per_rank_cycles: Sequence[int]) -> int:
    """The cycle count every rank agrees on (the all-reduce max).

    Ranks with fewer blocks run the extra cycles empty so the barriers match.
    """
    values = list(per_rank_cycles)
    if not values:
        raise ValueError(f"per_rank_cycles={per_rank_cycles!r}: expected at least one rank's count")
    return max(args.integer(f"per_rank_cycles[{i}]", v, minimum=1) for i, v in enumerate(values))
