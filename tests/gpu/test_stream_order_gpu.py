"""A streamed call's row reservations, ready list, seal and ticket order on the device, against the
CPU model (needs a Hopper GPU).

A probe kernel (cuda_src/probe/stream_order_walker.cu) runs what the fused kernel's streamed
consumer is to run, without GEMMs: dispatch warps reserve a pool row per pair as the (emulated)
producer publishes chunks, blocks join the ready list as they complete, the last chunk seals the
call, and ticket takers wait for their tasks as the fused kernel's producer warps would. The log
of tasks must be the sealed order of megamoe_rt/schedule/stream_fused.py:ticket_task, every pair
must own exactly one row of a block of its expert, and no task may run early.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from megamoe_rt.schedule.arith import ceil_div
from megamoe_rt.schedule.stream_fused import ticket_task
from tests.helpers.traps import SYNC_AND_REPORT

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

POISON = 0xFFFFFFFF
NO_PAIR = -1


def _pairs(rng: np.random.Generator, tokens: int, topk: int, experts: int, skew: float, drop: float) -> np.ndarray:
    """Local expert per (token, slot) pair, distinct within a token; ``skew`` sends most pairs to
    the first experts; a fraction ``drop`` of slots route elsewhere (-1)."""
    out = np.full((tokens, topk), -1, np.int32)
    weights = np.exp(-skew * np.arange(experts))
    weights /= weights.sum()
    for t in range(tokens):
        out[t] = rng.choice(experts, size=topk, replace=False, p=weights)
    out[rng.random(out.shape) < drop] = -1
    return out.reshape(-1)


def _walk(
    expert_of_pair,
    *,
    experts,
    topk,
    chunk,
    block_rows,
    grid,
    lag,
    l1_tiles,
    l2_tiles,
    publish_ns,
    timeout_s=20.0,
    sync=True,
):
    from megamoe_rt.kernels.interface.structs import ReadyBlocks
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import STREAM_ORDER_SPEC, StreamOrderProbeParams
    from megamoe_rt.runtime import driver
    from megamoe_rt.runtime.deadlines import TimeoutRecord

    pairs = len(expert_of_pair)
    tokens = pairs // topk
    num_chunks = ceil_div(tokens, chunk)
    blocks_per_expert = max(1, ceil_div(tokens, block_rows))  # one row per token at most
    max_blocks = experts * blocks_per_expert
    capacity = max_blocks * (l1_tiles + l2_tiles) + 16

    def zeros(n, dtype=cp.uint32):
        return cp.zeros(max(1, n), dtype=dtype)

    d = {
        "expert_of_pair": cp.asarray(expert_of_pair if pairs else np.zeros(1, np.int32)),
        "publish_ns": cp.asarray(np.asarray(publish_ns if num_chunks else [0], np.uint64)),
        "expert_counts": zeros(experts),
        "blocks_claimed": zeros(1),
        "expert_blocks": zeros(max_blocks),
        "state": zeros(max_blocks),
        "ready": zeros(max_blocks),
        "ready_count": zeros(1),
        "sealed": zeros(1),
        "parts_reserved": zeros(1),
        "ticket": zeros(1),
        "l1_done": zeros(max_blocks),
        "pool_pair": cp.full(max_blocks * block_rows, NO_PAIR, cp.int32),
        "task_log": cp.full(capacity * 4, POISON, cp.uint32),
        "checks": zeros(4),
        "times_ns": cp.asarray(np.array([np.iinfo(np.uint64).max, 0], np.uint64)),
    }
    ptr = {k: int(v.data.ptr) for k, v in d.items()}
    ready_words = ("state", "ready", "ready_count", "sealed")
    params = StreamOrderProbeParams(
        **{k: ptr[k] for k in ptr if k not in ready_words},
        ready=ReadyBlocks(**{k: ptr[k] for k in ready_words}, capacity=max_blocks),
        wait=TimeoutRecord.get().context(timeout_s=timeout_s),
        num_pairs=pairs,
        pairs_per_chunk=chunk * topk,
        num_chunks=num_chunks,
        num_experts=experts,
        block_rows=block_rows,
        blocks_per_expert=blocks_per_expert,
        lag=lag,
        l1_tiles=l1_tiles,
        l2_tiles=l2_tiles,
        capacity=capacity,
    )
    kernel = get_kernel(STREAM_ORDER_SPEC, driver.current_device())
    kernel.launch((grid,), (64,), [params])
    if not sync:  # a caller expecting a trap synchronises through the driver (tests/helpers/traps.py)
        return d
    cp.cuda.Device().synchronize()
    return {k: cp.asnumpy(v) for k, v in d.items()}


def _check(out, expert_of_pair, *, experts, block_rows, lag, l1_tiles, l2_tiles):
    assert out["checks"].tolist() == [0, 0, 0, 0], "a task ran early or twice, or the log overflowed"
    valid = np.flatnonzero(expert_of_pair >= 0)
    per_expert = np.bincount(expert_of_pair[valid], minlength=experts)
    positions = int(sum(ceil_div(int(n), block_rows) for n in per_expert))
    assert int(out["ready_count"][0]) == positions
    assert int(out["sealed"][0]) == positions + 1
    assert int(out["blocks_claimed"][0]) == positions
    ready = out["ready"][:positions].astype(np.int64) - 1
    assert sorted(ready.tolist()) == list(range(positions)), "the ready list is not every block once"

    # Every valid pair in exactly one row; a block's rows hold one expert's pairs, from row 0.
    rows = out["pool_pair"][: positions * block_rows].reshape(positions, block_rows)
    filled = rows[rows != NO_PAIR]
    assert sorted(filled.tolist()) == valid.tolist()
    for b in range(positions):
        used = rows[b][rows[b] != NO_PAIR]
        n = len(used)
        assert n >= 1 and (rows[b][:n] != NO_PAIR).all(), f"block {b}: rows not packed from the start"
        assert len(set(expert_of_pair[used].tolist())) == 1, f"block {b} mixes experts"
        assert (out["state"][b] >> 16) == n and (out["state"][b] & 0xFFFF) == n

    # The log is the sealed order, each task on the block at its position.
    log = out["task_log"].reshape(-1, 4)
    t = 0
    while (task := ticket_task(t, lag, l1_tiles, l2_tiles, positions)) is not None:
        kind, position, tile = task
        assert log[t].tolist() == [int(kind == "l2"), position, tile, int(ready[position])], f"ticket {t}"
        t += 1
    assert (log[t:] == POISON).all(), "tasks past the sealed order's end"


CASES = [
    # tokens, topk, experts, chunk, block_rows, grid, lag, l1_tiles, l2_tiles, skew, drop, spacing_us
    (0, 4, 8, 16, 16, 4, 1, 2, 1, 0.0, 0.0, 0),
    (5, 2, 4, 16, 16, 3, 1, 2, 1, 0.0, 1.0, 0),  # every pair dropped: sealed with no position
    (1, 1, 1, 1, 4, 1, 0, 1, 1, 0.0, 0.0, 0),
    (37, 4, 8, 5, 4, 3, 1, 2, 3, 0.5, 0.1, 50),
    (200, 6, 16, 32, 16, 8, 2, 3, 2, 1.0, 0.05, 200),
    (512, 8, 32, 64, 128, 16, 4, 4, 3, 0.3, 0.0, 100),
    (300, 2, 3, 7, 8, 32, 3, 1, 1, 0.0, 0.2, 0),
    (1024, 6, 64, 128, 64, 64, 8, 2, 2, 0.2, 0.02, 20),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}k{}e{}c{}b{}g{}lag{}".format(*c[:7]))
def test_the_device_runs_the_streamed_order(case):
    tokens, topk, experts, chunk, block_rows, grid, lag, l1, l2, skew, drop, spacing_us = case
    rng = np.random.default_rng(hash(case) & 0xFFFF)
    pairs = _pairs(rng, tokens, topk, experts, skew, drop)
    num_chunks = ceil_div(tokens, chunk)
    publish = [c * spacing_us * 1000 for c in range(num_chunks)]
    shape = dict(experts=experts, block_rows=block_rows, lag=lag, l1_tiles=l1, l2_tiles=l2)
    out = _walk(pairs, topk=topk, chunk=chunk, grid=grid, publish_ns=publish, **shape)
    _check(out, pairs, **shape)


def test_full_blocks_reach_l1_before_the_last_chunk_is_published():
    """Routing that fills blocks in the first chunks: their L1 tasks start while later chunks are
    still unpublished (the overlap streaming exists for)."""
    tokens, topk, experts, chunk, block_rows = 256, 4, 4, 32, 16
    rng = np.random.default_rng(3)
    pairs = _pairs(rng, tokens, topk, experts, 0.0, 0.0)
    publish = [c * 5_000_000 for c in range(ceil_div(tokens, chunk))]  # 5 ms apart
    shape = dict(experts=experts, block_rows=block_rows, lag=1, l1_tiles=2, l2_tiles=2)
    out = _walk(pairs, topk=topk, chunk=chunk, grid=8, publish_ns=publish, **shape)
    _check(out, pairs, **shape)
    first_l1, last_publish = (int(v) for v in out["times_ns"])
    assert first_l1 + 10_000_000 < last_publish, "no L1 task started before the last chunk was published"


_NEVER_PUBLISHED = (
    textwrap.dedent("""
    import sys
    import numpy as np
    from megamoe_rt.runtime import driver
    from cuda.bindings import driver as cu
    from tests.gpu.test_stream_order_gpu import _walk
    driver.ensure_context()
    # Two chunks of 8 tokens, every pair on expert 0: chunk 0 fills block 0 (8 rows), chunk 1
    # would fill block 1 but is published only after 60 s, past the 0.3 s deadline.
    pairs = np.zeros(16, np.int32)
    shape = dict(experts=1, topk=1, chunk=8, block_rows=8, grid=2, lag=1, l1_tiles=1, l2_tiles=1)
    arrays = _walk(pairs, publish_ns=[0, 60_000_000_000], timeout_s=0.3, sync=False, **shape)
""")
    + SYNC_AND_REPORT
)


def test_a_chunk_never_published_traps_naming_the_ready_list_position():
    out = subprocess.run([sys.executable, "-c", _NEVER_PUBLISHED], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert "wait 'stream block ready' timed out" in text, text
    assert "ready-list position 1 never filled (1 blocks had completed)" in text, text
