"""The fused kernel's task order as the device walks it, against the CPU model (needs a Hopper GPU).

A probe kernel (cuda_src/probe/task_order_walker.cu) builds the unit table from per-expert
block counts and walks the order with the fused kernel's own code (fused/unit_table.cuh,
fused/task_order.cuh), writing every tile in order. That order, cut into tasks, must be the
model's order (megamoe_rt/schedule/task_order.py: lag_task_order, single_wave_order)
with each task expanded by task_tiles, and check_order must accept it.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from megamoe_rt.schedule.plan import fused_schedule
from megamoe_rt.schedule.task_order import (
    Task,
    check_order,
    expert_units,
    lag_task_order,
    ring_blocks_for,
    single_wave_order,
    task_tiles,
)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

POISON = 0xFFFFFFFF
SLACK_TILES = 64  # rows past the expected end that must stay poisoned
SINGLE_WAVE_GROUP = 4  # the group the host passes with a single-wave lag (modes/fused.py)
BLOCK_M = 64  # the fused kernel's rows per pool block (kernels/fused.py BLOCK_M)


def _block_vectors() -> list[list[int]]:
    """Per-expert block counts: edge cases, then random ones from a fixed seed."""
    vectors = [
        [0],
        [1],
        [7],
        [8],
        [9],
        [0, 0, 0],
        [0, 0, 5, 0],
        [64],
        [201],
        [0, 3, 17, 8],
        [8] * 20,
        [1] * 40,
        [3, 0] * 17,
        list(range(33)),
    ]
    rng = np.random.default_rng(7)
    for _ in range(40):
        e = int(rng.choice([1, 2, 5, 8, 16, 31, 32, 33, 64, 100, 256, 384]))
        hi = int(rng.choice([2, 9, 24, 40]))
        b = rng.integers(0, hi + 1, size=e)
        b[rng.random(e) < 0.25] = 0  # empty experts
        if rng.random() < 0.3:
            b[rng.integers(0, e)] = rng.integers(50, 300)  # one hot expert: many units
        if b.sum() > 6000:  # keep tiles (and shared memory) small
            b = b * 6000 // b.sum()
        vectors.append([int(x) for x in b])
    return vectors


VECTORS = _block_vectors()

# lag, group, l1 n-blocks, l2 n-blocks of the lag-ordered runs (None: a lag past the unit count)
LAG_SCHEDULES = [
    (0, 1, 1, 1),
    (1, 1, 2, 1),
    (3, 4, 1, 3),
    (8, 4, 2, 3),
    (8, 1, 3, 2),
    (13, 3, 4, 1),
    (29, 4, 2, 2),
    (64, 8, 1, 2),
    (None, 4, 2, 3),
]


def _smem_bytes(num_experts: int) -> int:
    # The probe's tables, laid out as the fused kernel's (header comment of the probe).
    from megamoe_rt.kernels.interface.fused import unit_table_bytes

    return unit_table_bytes(num_experts)


def _run_probe(blocks, lag, group, n1, n2, *, max_blocks=None, capacity=None):
    """The device order: (tiles [capacity, 4] as l2, block, expert, n_block; info [4])."""
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import TASK_ORDER_SPEC
    from megamoe_rt.runtime import driver

    total = sum(blocks)
    max_blocks = max(total, 1) if max_blocks is None else max_blocks
    capacity = total * (n1 + n2) + SLACK_TILES if capacity is None else capacity
    assert group >= 1
    counts = cp.asarray(np.asarray(blocks, np.uint32))
    tiles = cp.full((max(capacity, 1), 4), POISON, dtype=cp.uint32)
    info = cp.full(4, POISON, dtype=cp.uint32)
    kernel = get_kernel(TASK_ORDER_SPEC, driver.current_device())
    args = [
        ctypes.c_uint64(int(counts.data.ptr)),
        ctypes.c_uint32(len(blocks)),
        ctypes.c_uint32(max_blocks),
        ctypes.c_uint32(lag),
        ctypes.c_uint32(group),
        ctypes.c_uint32(n1),
        ctypes.c_uint32(n2),
        ctypes.c_uint64(int(tiles.data.ptr)),
        ctypes.c_uint32(capacity),
        ctypes.c_uint64(int(info.data.ptr)),
    ]
    kernel.launch((1,), (32,), args, smem_bytes=_smem_bytes(len(blocks)))
    cp.cuda.get_current_stream().synchronize()
    return cp.asnumpy(tiles), cp.asnumpy(info)


def _as_rows(tiles) -> np.ndarray:
    return np.array([(t.kind == "l2", t.block, t.expert, t.n_block) for t in tiles], dtype=np.uint32).reshape(-1, 4)


def _device_tasks(blocks, rows: np.ndarray, n1: int, n2: int) -> list[Task]:
    """Cut the device order into tasks, each checked tile for tile against task_tiles.

    A task starts at its first tile's (kind, unit) and runs for that unit's blocks x n-blocks
    tiles; a repeated task then shows up as a task of its own (check_order rejects it)."""
    units = expert_units(blocks)
    unit_of_block = [u for u in units for _ in u.blocks]
    tasks: list[Task] = []
    pos = 0
    while pos < len(rows):
        l2, block = int(rows[pos, 0]), int(rows[pos, 1])
        assert l2 in (0, 1) and block < len(unit_of_block), f"tile {pos}: {rows[pos].tolist()} is no tile of the pool"
        task = Task("l2" if l2 else "l1", unit_of_block[block])
        want = _as_rows(task_tiles(task, n1, n2))
        got = rows[pos : pos + len(want)]
        assert np.array_equal(got, want), (
            f"tiles {pos}..{pos + len(want) - 1} ({task.kind} of unit {task.unit.index}): device {got.tolist()}, "
            f"model {want.tolist()}"
        )
        tasks.append(task)
        pos += len(want)
    return tasks


def _check_against_model(blocks, lag, group, n1, n2, model: list[Task], ring_blocks: int):
    where = f"blocks {blocks}, lag {lag}, group {group}, n-blocks {n1}/{n2}"
    rows, info = _run_probe(blocks, lag, group, n1, n2)
    expected = sum(blocks) * (n1 + n2)
    assert info.tolist() == [expected, len(expert_units(blocks)), sum(blocks), 0], f"{where}: info {info.tolist()}"
    assert (rows[expected:] == POISON).all(), f"{where}: written past the order's {expected} tiles"
    device = _device_tasks(blocks, rows[:expected], n1, n2)
    assert [(t.kind, t.unit.index) for t in device] == [(t.kind, t.unit.index) for t in model], where
    check_order(device, ring_blocks)
    # The whole order at once, as the model expands it.
    assert np.array_equal(rows[:expected], _as_rows([x for t in model for x in task_tiles(t, n1, n2)])), where


@pytest.mark.parametrize("blocks", VECTORS, ids=[f"v{i}" for i in range(len(VECTORS))])
def test_lag_task_order_on_the_device_is_the_model(blocks):
    units = len(expert_units(blocks))
    for lag, group, n1, n2 in LAG_SCHEDULES:
        lag = units + 3 if lag is None else lag
        _check_against_model(
            blocks, lag, group, n1, n2, lag_task_order(blocks, lag, group), ring_blocks_for(lag, group)
        )


@pytest.mark.parametrize("blocks", VECTORS, ids=[f"v{i}" for i in range(len(VECTORS))])
def test_single_wave_order_on_the_device_is_the_model(blocks):
    # The host's single wave: a lag of the worst-case pool (here the pool itself), so no L2
    # task before the last L1 task; the ring holds the whole pool.
    total = sum(blocks)
    _check_against_model(blocks, max(total, 1), SINGLE_WAVE_GROUP, 2, 3, single_wave_order(blocks), max(total, 1))


@pytest.mark.parametrize("tokens,topk,experts", [(2048, 6, 16), (4096, 8, 32), (300, 4, 64)])
def test_the_hosts_schedule_on_a_routing_at_real_n_blocks(tokens, topk, experts):
    # Blocks per expert from a random routing; lag, group and ring as the host sizes them.
    rng = np.random.default_rng(tokens + experts)
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk]
    rows = np.bincount(picks.ravel(), minlength=experts)
    blocks = [int(-(-r // BLOCK_M)) for r in rows]
    sched = fused_schedule(tokens, 1, topk, experts, block_m=BLOCK_M)
    _check_against_model(
        blocks,
        sched.lag_units,
        sched.group_units,
        2 * 2048 // 256,
        7168 // 256,
        lag_task_order(blocks, sched.lag_units, sched.group_units),
        sched.ring_blocks,
    )


def test_a_walk_past_the_output_is_counted_and_not_written():
    blocks = [5, 0, 12]
    order = lag_task_order(blocks, 1, 1)
    want = _as_rows([x for t in order for x in task_tiles(t, 2, 2)])
    rows, info = _run_probe(blocks, 1, 1, 2, 2, capacity=10)
    assert int(info[0]) == 11  # one past the capacity: the walk runs on
    assert np.array_equal(rows[:10], want[:10])


def test_a_pool_past_max_blocks_walks_nothing():
    rows, info = _run_probe([9, 9], 1, 1, 1, 1, max_blocks=17)
    assert info.tolist() == [0, 4, 18, 1]  # 4 units, 18 blocks, overflow
    assert (rows == POISON).all()
