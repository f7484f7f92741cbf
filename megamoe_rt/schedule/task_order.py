"""Model of the fused kernel's task order and its ring-pool safety.

The fused kernel walks its tasks in one order. A *unit* is up to ``UNIT_BLOCKS``
consecutive m-blocks of one expert; units are numbered in expert order. The L1
tasks of unit ``u`` come in order, and the L2 tasks of a unit come ``lag`` units
after its L1 tasks, released in groups of ``group`` units. The L1 output pool is
a ring of ``ring_blocks`` slots: the L1 output of the ``b``-th block (in L1 order)
lives in slot ``b % ring_blocks`` until its L2 task has read it.

This module builds that order from per-expert block counts and checks, in task
order, that no L1 task overwrites a slot whose previous block's L2 task has not
come yet (the device waits there for that block's ``l2_read`` count, wait site
``ring_slot_free``, which can only be satisfied by an earlier task), and that every
L1 task precedes its L2 task. The host uses the same functions to assert its ring
size; CPU property tests drive them with random routings.

Each task is a run of GEMM tiles on the device; :func:`task_tiles` is the contract for which
tiles and in what order. A GPU test (tests/gpu/test_task_order_gpu.py) dumps the order the
device walk (cuda_src/fused/task_order.cuh) hands tiles out and checks it against
:func:`lag_task_order` / :func:`single_wave_order` expanded by :func:`task_tiles`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megamoe_rt.schedule.plan import LAG_GROUP_UNITS, RING_MARGIN_BLOCKS, UNIT_BLOCKS


@dataclass(frozen=True)
class Unit:
    index: int  # position in L1 order
    expert: int
    first_block: int  # global L1 block sequence number of its first block
    num_blocks: int  # 1..UNIT_BLOCKS

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.first_block + self.num_blocks)


@dataclass(frozen=True)
class Task:
    kind: str  # "l1" or "l2"
    unit: Unit


@dataclass(frozen=True)
class Tile:
    kind: str  # "l1" (gate|up GEMM + SwiGLU) or "l2" (down projection)
    block: int  # pool block: its BLOCK_M rows
    expert: int
    n_block: int  # which BLOCK_N columns of the GEMM's N


def task_tiles(task: Task, l1_n_blocks: int, l2_n_blocks: int) -> list[Tile]:
    """The tiles of one task, in the order the device hands them out.

    A task over a unit of ``b`` blocks is ``b * n`` tiles, ``n`` being its GEMM's N in
    tiles (``l1_n_blocks`` for L1, ``l2_n_blocks`` for L2), n-block-major: n-block 0 of each
    of the unit's blocks in pool order, then n-block 1, and so on. Consecutive order
    positions go to concurrently running blocks, so this order has them share each weight
    tile among the unit's row blocks. The fused kernel's walk must produce exactly this
    (tests/gpu/test_task_order_gpu.py).
    """
    n = l2_n_blocks if task.kind == "l2" else l1_n_blocks
    u = task.unit
    return [Tile(task.kind, b, u.expert, j) for j in range(n) for b in u.blocks]


def expert_units(blocks_per_expert: Sequence[int]) -> list[Unit]:
    """Split each expert's m-blocks into units of at most UNIT_BLOCKS, in expert order."""
    units: list[Unit] = []
    block = 0
    for expert, n in enumerate(blocks_per_expert):
        if n < 0:
            raise ValueError(f"blocks_per_expert[{expert}] = {n}: expected >= 0")
        done = 0
        while done < n:
            take = min(UNIT_BLOCKS, n - done)
            units.append(Unit(len(units), expert, block, take))
            block += take
            done += take
    return units


def lag_task_order(blocks_per_expert: Sequence[int], lag: int, group: int = LAG_GROUP_UNITS) -> list[Task]:
    """L1 tasks in unit order; after L1 of unit j, at each group boundary, the L2 tasks of
    the group of units that are now at least ``lag`` units behind; the rest at the end."""
    if lag < 0 or group < 1:
        raise ValueError(f"lag={lag}, group={group}: expected lag >= 0 and group >= 1")
    units = expert_units(blocks_per_expert)
    order: list[Task] = []
    next_l2 = 0
    for j, unit in enumerate(units):
        order.append(Task("l1", unit))
        # Units [next_l2, j + 1 - lag) are at least `lag` units behind; release whole groups.
        while j + 1 - lag - next_l2 >= group:
            order.extend(Task("l2", units[u]) for u in range(next_l2, next_l2 + group))
            next_l2 += group
    order.extend(Task("l2", units[u]) for u in range(next_l2, len(units)))
    return order


def single_wave_order(blocks_per_expert: Sequence[int]) -> list[Task]:
    """Every L1 task, then every L2 task: the order of calls whose whole pool fits."""
    units = expert_units(blocks_per_expert)
    return [Task("l1", u) for u in units] + [Task("l2", u) for u in units]


def ring_blocks_for(lag: int, group: int = LAG_GROUP_UNITS) -> int:
    """The ring size the fused schedule uses: the live window plus a margin."""
    return UNIT_BLOCKS * (lag + group) + RING_MARGIN_BLOCKS


class RingViolation(AssertionError):
    pass


def check_order(order: Sequence[Task], ring_blocks: int) -> int:
    """Validate a task order against a ring; return the most blocks live at once.

    Raises RingViolation when an L2 task precedes its L1 task, a unit's tasks repeat or
    are missing, or an L1 task would overwrite a slot whose previous block has not yet had
    its L2 task (in task order: a wait nothing earlier can satisfy).
    """
    if ring_blocks < 1:
        raise ValueError(f"ring_blocks={ring_blocks}: expected >= 1")
    slot_owner: dict[int, int] = {}  # slot -> block whose L1 output it holds
    l1_done: set[int] = set()
    l2_done: set[int] = set()
    read_blocks: set[int] = set()  # blocks whose L2 task has been issued
    live = 0
    max_live = 0
    for pos, task in enumerate(order):
        u = task.unit
        if task.kind == "l1":
            if u.index in l1_done:
                raise RingViolation(f"task {pos}: L1 of unit {u.index} issued twice")
            for b in u.blocks:
                slot = b % ring_blocks
                prev = slot_owner.get(slot)
                if prev is not None and prev not in read_blocks:
                    raise RingViolation(
                        f"task {pos}: L1 of block {b} (unit {u.index}) overwrites ring slot {slot} "
                        f"while block {prev} still waits for its L2"
                    )
                slot_owner[slot] = b
            l1_done.add(u.index)
            live += u.num_blocks
            max_live = max(max_live, live)
        elif task.kind == "l2":
            if u.index not in l1_done:
                raise RingViolation(f"task {pos}: L2 of unit {u.index} comes before its L1")
            if u.index in l2_done:
                raise RingViolation(f"task {pos}: L2 of unit {u.index} issued twice")
            l2_done.add(u.index)
            read_blocks.update(u.blocks)
            live -= u.num_blocks
        else:
            raise ValueError(f"task {pos}: unknown kind {task.kind!r}")
    if l1_done != l2_done:
        raise RingViolation(f"units without an L2 task: {sorted(l1_done - l2_done)[:8]}")
    return max_live


# --- prefill: the dispatch pull in cycles --------------------------------------------------


def pull_cycles(
    blocks_per_expert: Sequence[int], ring_blocks: int, num_cycles: int | None = None
) -> list[list[tuple[int, int]]]:
    """Split the pool's blocks (in expert order) into pull cycles of at most ``ring_blocks``.

    Returns, per cycle, the ``(expert, block)`` pairs pulled in it. ``num_cycles`` (the
    cross-rank maximum) pads a rank that needs fewer cycles with empty ones: every rank must
    run the same number of cycles, since each cycle ends in a grid-wide synchronisation.
    """
    if ring_blocks < 1:
        raise ValueError(f"ring_blocks={ring_blocks}: expected >= 1")
    blocks = [(e, b) for e, n in enumerate(blocks_per_expert) for b in range(n)]
    cycles = [blocks[i : i + ring_blocks] for i in range(0, len(blocks), ring_blocks)] or [[]]
    if num_cycles is not None:
        if num_cycles < len(cycles):
            raise ValueError(f"num_cycles={num_cycles}: this rank needs {len(cycles)}")
        cycles += [[] for _ in range(num_cycles - len(cycles))]
    return cycles
