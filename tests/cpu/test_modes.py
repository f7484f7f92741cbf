"""Execution modes as objects: the registry, mode selection, the layout each mode needs, the
per-bound schedule cache and the testing hooks, all without a GPU (CPU).

The modes are bound to a buffer that only resolves addresses (no device memory), and the fused
mode's launch plan is replaced by a recorder, so a call's host side runs end to end.
"""

from __future__ import annotations

import pytest

from megamoe_rt import testing
from megamoe_rt.kernels import fused as fk
from megamoe_rt.kernels import moe as mk
from megamoe_rt.modes import base, fused
from megamoe_rt.modes.base import Call, LayerSpec, LayoutNeeds, Mode, buffer_layout
from megamoe_rt.modes.fused import CallSchedule, FusedMode, buffer_schedule, call_schedule
from megamoe_rt.modes.registry import DEFAULT_ORDER, MODES, select_mode
from megamoe_rt.modes.split import SplitMode
from megamoe_rt.modes.unfused import UnfusedMode
from megamoe_rt.runtime.buffer import LaidOutBuffer

BASE_PTR = 1 << 40


class AddressOnlyBuffer(LaidOutBuffer):
    """Region addresses of a layout at a made-up base; no memory behind them."""

    def __init__(self, layout, rank=0):
        self.layout, self.device, self.base_ptr, self.rank = layout, 0, BASE_PTR, rank


class RecordingPlan:
    """Stands in for FusedPlan: builds the parameter struct from the schedule, records launches."""

    def __init__(self):
        self.launches = []

    def params(self, moe, schedule, *, timeout_s=None):
        return fk.FusedParams(
            moe=moe, lag_units=schedule.lag_units, group_units=schedule.group_units, withhold_block=fk.NO_BLOCK
        )

    def launch(self, idx, params, stream, *, programmatic=False):
        self.launches.append((idx, params, stream, programmatic))


def _spec(h=512, i=256, e=16, k=6, cap=2048, **kw):
    return LayerSpec(h, i, e, k, cap, **kw)


def _mode(cls, spec, ring_blocks=None):
    layout = buffer_layout(spec, cls.layout_needs(spec, ring_blocks))
    mode = cls(spec, layout)
    mode.bind(AddressOnlyBuffer(layout, spec.rank))
    return mode


def _call(t=100, bound=2048, idx="int32"):
    return Call(
        x=0x1000, x_sf=0x2000, topk_idx=0x3000, topk_weights=0x4000, y=0x5000, num_tokens=t, idx=idx, bound=bound
    )


# --- registry and selection ----------------------------------------------------------------


def test_registry_names_the_mode_classes_and_the_layer_lists_them():
    from megamoe_rt.layer import MODES as LAYER_MODES

    assert LAYER_MODES == tuple(MODES) == ("unfused", "fused", "split")
    assert "split" not in DEFAULT_ORDER  # holds green contexts: only when asked for
    for name, cls in MODES.items():
        assert issubclass(cls, Mode) and cls.name == name
    assert set(DEFAULT_ORDER) <= set(MODES)
    # Every default candidate but the last may refuse a shape; the last runs every shape.
    assert MODES[DEFAULT_ORDER[-1]].refusal(_spec(h=384, num_ranks=64, e=64)) is None


def test_the_registry_facts_agree_with_the_mode_classes():
    from megamoe_rt.modes.fused import FusedMode
    from megamoe_rt.modes.registry import FUSED_KERNEL, SM_PARTITIONED, baseline_mode, default_mode

    # The fused kernel's modes: its block tables and its per-block trace rows.
    assert set(FUSED_KERNEL) == {n for n, cls in MODES.items() if issubclass(cls, FusedMode)}
    assert set(FUSED_KERNEL) == {n for n, cls in MODES.items() if hasattr(cls, "trace_rows")}
    assert set(SM_PARTITIONED) <= set(FUSED_KERNEL)  # K1 and K2 are the fused kernel's roles
    assert (default_mode(), baseline_mode()) == (DEFAULT_ORDER[0], DEFAULT_ORDER[-1])
    assert default_mode(FUSED_KERNEL) == "fused" and default_mode(SM_PARTITIONED) == "split"


def test_the_registry_lists_and_checks_names_without_importing_a_mode():
    import subprocess
    import sys

    code = (
        "import sys; from megamoe_rt.modes import registry as r; "
        "assert list(r.MODES) == list(r.mode_names()) and 'fused' in r.MODES and 'nope' not in r.MODES; "
        "print(sorted(k for k in sys.modules if k.startswith('megamoe_rt.modes.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['megamoe_rt.modes.registry']"


@pytest.mark.parametrize(
    "spec,expected",
    [
        (_spec(), "fused"),
        (_spec(h=384), "unfused"),  # the fused L2 tile is 256 wide
        (_spec(e=64, num_ranks=32), "fused"),
        (_spec(e=66, num_ranks=33), "unfused"),  # the fused kernel runs on at most 32 ranks
    ],
)
def test_the_default_is_the_first_mode_that_runs_the_shape(spec, expected):
    assert select_mode(None, spec) is MODES[expected]


def test_mode_arguments_are_checked_with_the_layer_messages():
    with pytest.raises(
        ValueError, match=r"mode: expected one of \('unfused', 'fused', 'split'\) or None, got 'split-ish'"
    ):
        select_mode("split-ish", _spec())
    with pytest.raises(ValueError, match="mode: expected one of"):
        select_mode(["fused"], _spec())  # not a name (and not hashable)
    with pytest.raises(ValueError, match="hidden=384: mode='fused' needs a multiple of 256"):
        select_mode("fused", _spec(h=384))
    with pytest.raises(ValueError, match="group: 33 ranks; mode='fused' runs on at most 32"):
        select_mode("fused", _spec(h=384, e=66, num_ranks=33))  # the rank count is reported first
    assert select_mode("unfused", _spec(), ring_blocks=50) is UnfusedMode  # every mode takes a ring
    with pytest.raises(ValueError, match="hidden=384: mode='split' needs a multiple of 256"):
        select_mode("split", _spec(h=384))
    with pytest.raises(ValueError, match=r"split_sms=\(64, 64, 132\): only mode='split' takes SM counts"):
        select_mode("fused", _spec(), split_sms=(64, 64, 132))
    # More ranks than the unfused kernels' one-thread-per-rank signalling covers.
    with pytest.raises(ValueError, match="group: 257 ranks; mode='unfused' runs on at most 256"):
        select_mode("unfused", _spec(e=257, num_ranks=257))
    with pytest.raises(ValueError, match="no mode runs this layer: group: 257 ranks; mode='fused' runs on at most 32"):
        select_mode(None, _spec(e=257, num_ranks=257))
    assert select_mode(None, _spec(h=384), ring_blocks=50) is UnfusedMode  # the default fell back to unfused
    assert select_mode("fused", _spec(), ring_blocks=500) is FusedMode


def test_the_layer_checks_the_mode_before_looking_for_a_gpu():
    from megamoe_rt.layer import MegaMoE

    with pytest.raises(ValueError, match="mode"):
        MegaMoE(512, 256, 8, 2, 64, mode="split-ish")
    with pytest.raises(ValueError, match="hidden=384: mode='fused' needs a multiple of 256"):
        MegaMoE(384, 256, 8, 2, 64, mode="fused")
    with pytest.raises(ValueError, match="pass one of them"):
        MegaMoE(512, 256, 8, 2, 64, mode="unfused", ring_blocks=10, chunk_ratio=0.5)


def test_a_device_other_than_the_rank_groups_is_refused_before_looking_for_a_gpu():
    from megamoe_rt.layer import MegaMoE

    class Group:  # rank 1 of 2, on device 1; refused before any collective
        rank, world_size, device = 1, 2, 1

        def broadcast(self, value, *, key="default", root=0):
            raise AssertionError("no collective expected")

        barrier = allgather = broadcast

    with pytest.raises(ValueError, match="device=0: the rank group runs this rank on device 1"):
        MegaMoE(512, 256, 8, 2, 64, device=0, group=Group())


def test_each_mode_says_which_buffer_it_needs():
    spec = _spec()
    assert UnfusedMode.layout_needs(spec) == LayoutNeeds(pool="full", block_m=128)
    assert FusedMode.layout_needs(spec) == LayoutNeeds(pool="ring", block_m=fk.BLOCK_M)
    assert FusedMode.layout_needs(spec, 300).ring_blocks == 300
    assert SplitMode.layout_needs(spec) == LayoutNeeds(pool="full", block_m=fk.BLOCK_M)
    assert SplitMode.layout_needs(spec, 300) == LayoutNeeds(pool="ring", block_m=fk.BLOCK_M, ring_blocks=300)
    unfused = buffer_layout(spec, UnfusedMode.layout_needs(spec))
    ring = buffer_layout(spec, FusedMode.layout_needs(spec))
    assert (unfused.pool, unfused.block_m, ring.pool, ring.block_m) == ("full", 128, "ring", 64)
    assert ring.pool_blocks == buffer_schedule(ring).ring_blocks < buffer_schedule(ring).full_pool_blocks
    assert UnfusedMode.layout_needs(spec, 30) == LayoutNeeds(pool="ring", block_m=128, ring_blocks=30)


def test_an_unfused_ring_runs_the_cycles_its_bound_can_need_and_no_fewer_than_one():
    spec = _spec(h=512, i=256, e=16, k=6, cap=8192)
    full = buffer_layout(spec, UnfusedMode.layout_needs(spec)).pool_blocks  # 8192 * 6 rows + padding
    assert full == (8192 * 6 + 16 * 127) // 128
    quarter = _mode(UnfusedMode, spec, ring_blocks=full // 4)
    assert quarter.ring and quarter.layout.pool_rows == (full // 4) * 128
    assert quarter.cycles_to_launch(8192) == -(-full // (full // 4))  # ceil: 4 or 5
    assert quarter.cycles_to_launch(64) == 1  # a small call's worst case fits one window
    assert quarter.cycles_to_launch(2048) == -(-((2048 * 6 + 16 * 127) // 128) // (full // 4))
    whole = _mode(UnfusedMode, spec, ring_blocks=10 * full)  # clamped to the pool: no ring
    assert not whole.ring and whole.layout.pool_blocks == full and whole.cycles_to_launch(8192) == 1
    notes = quarter.memory_notes()
    assert notes.startswith(f"unfused pools: ring of {full // 4} blocks x 128 rows") and "at most" in notes


def test_an_unfused_ring_below_its_minimum_is_refused_when_the_mode_is_created():
    spec = _spec(h=512, i=256, e=16, k=6, cap=8192)
    minimum = UnfusedMode.minimum_ring_blocks(spec)
    full = buffer_layout(spec, UnfusedMode.layout_needs(spec)).pool_blocks
    assert minimum == -(-full // 64) > 1
    with pytest.raises(
        ValueError, match=f"ring_blocks={minimum - 1}: mode='unfused' runs a ring of at least {minimum}"
    ):
        _mode(UnfusedMode, spec, ring_blocks=minimum - 1)
    assert _mode(UnfusedMode, spec, ring_blocks=minimum).ring


def test_a_ring_below_the_live_window_is_refused_when_the_mode_is_created():
    spec = _spec(h=512, i=256, e=16, k=6, cap=8192)
    layout = buffer_layout(spec, FusedMode.layout_needs(spec, 50))
    with pytest.raises(ValueError, match="live"):
        FusedMode(spec, layout)


# --- binding: the fixed part of a call's parameters ------------------------------------------


@pytest.mark.parametrize(
    "cls,ranks,counts",
    [
        (UnfusedMode, 1, "expert_recv_counts"),
        (UnfusedMode, 2, "ep_expert_totals"),
        (FusedMode, 1, "expert_recv_counts"),
        (FusedMode, 2, "expert_recv_counts"),
    ],
)
def test_moe_params_of_a_call(monkeypatch, cls, ranks, counts):
    tables = []
    monkeypatch.setattr(base, "write_peer_table", tables.append)
    spec = _spec(num_ranks=ranks, rank=ranks - 1)
    mode = _mode(cls, spec)
    assert len(tables) == (ranks > 1)  # the peer table is written once, at bind
    b = mode.buffer
    p = mode.moe_params(_call(t=100))
    assert isinstance(p, mk.MoeParams)
    assert (p.x, p.x_sf, p.topk_idx, p.topk_weights, p.y, p.num_tokens) == (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 100)
    assert p.pool_align == mode.layout.block_m and p.pool_rows == mode.layout.pool_rows
    assert p.token_capacity == mode.layout.num_max_tokens_per_rank
    assert p.num_local_experts == 16 // ranks and p.first_local_expert == (ranks - 1) * 16 // ranks
    assert p.expert_counts == b.ptr(counts) and p.combine == b.ptr("combine") and p.pool == b.ptr("l1_pool")
    assert p.expert_recv_stats == 0


# --- the fused mode's schedules --------------------------------------------------------------


def test_each_bound_schedule_is_derived_once_and_the_buffer_schedule_at_creation(monkeypatch):
    derived = []

    def counting(layout, buffer, bound):
        derived.append(bound)
        return call_schedule(layout, buffer, bound)

    monkeypatch.setattr(fused, "call_schedule", counting)
    spec = _spec(cap=2048)
    mode = _mode(FusedMode, spec)
    assert mode.schedules.buffer == buffer_schedule(mode.layout)
    assert len(mode.schedules) == 0
    mode.plan = RecordingPlan()
    for bound in (2048, 64, 2048, 2048, 64, 1200):
        mode.run(_call(t=min(bound, 100), bound=bound), stream=7)
    assert derived == [2048, 64, 1200]
    assert mode.schedules.for_bound(2048) is mode.schedules.for_bound(2048)
    launches = mode.plan.launches
    for (idx, params, stream, programmatic), bound in zip(launches, (2048, 64, 2048, 2048, 64, 1200)):
        expected = call_schedule(mode.layout, mode.schedules.buffer, bound)
        assert (params.lag_units, params.group_units) == (expected.lag_units, expected.group_units)
        assert (idx, stream, programmatic) == ("int32", 7, bound <= fused.PDL_MAX_TOKENS)
        assert params.withhold_block == fk.NO_BLOCK and params.trace == 0


def test_testing_hooks_change_the_launch_parameters_only_inside_their_block():
    mode = _mode(FusedMode, _spec())
    mode.plan = RecordingPlan()
    forced = CallSchedule(True, 1234, 4)
    with testing.withhold_block(mode, 5), testing.trace_into(mode, 0xABC0):
        with testing.force_call_schedule(mode, forced):
            mode.run(_call(), 0)
        mode.run(_call(), 0)
    mode.run(_call(), 0)
    (_, inner, _, _), (_, middle, _, _), (_, outer, _, _) = mode.plan.launches
    assert (inner.withhold_block, inner.trace, inner.lag_units) == (5, 0xABC0, 1234)
    assert (middle.withhold_block, middle.trace) == (5, 0xABC0) and middle.lag_units != 1234
    assert (outer.withhold_block, outer.trace) == (fk.NO_BLOCK, 0) and mode.params_transforms == ()
    assert testing.fused_schedule_of(mode) is mode.schedules.buffer


def test_testing_hooks_refuse_other_modes():
    with pytest.raises(TypeError, match="mode 'unfused'"):
        testing.withhold_block(_mode(UnfusedMode, _spec()), 0).__enter__()


def test_memory_notes():
    assert _mode(UnfusedMode, _spec()).memory_notes() == "unfused pools: full pool of 111 blocks x 128 rows = 10.73 MiB"
    mode = _mode(FusedMode, _spec())
    notes = mode.memory_notes()
    s = mode.schedules.buffer
    assert notes.startswith(f"fused pools: ring of {mode.layout.pool_blocks} blocks x 64 rows")
    assert f"vs full pool of {s.full_pool_blocks} blocks" in notes
    assert notes.endswith(f"schedule at capacity: lag {s.lag_units} units, group {s.group_units}")


# --- a streamed call through the call-wide pool (one rank) -----------------------------------


class _Recorder:
    """Stands in for loaded kernels, GEMM plans and the ring's launches: records what a call
    enqueues, in order."""

    def __init__(self):
        self.log = []

    def kernel(self, name):
        rec = self

        class K:
            def launch(self, grid, block, args, stream=None, cluster=None):
                rec.log.append((name, args[0], stream))

        return K()

    def plan(self, name):
        rec = self

        class P:
            def run_block_mapped(self, stream, block_map):
                rec.log.append((name, block_map, stream))

        return P()


def _streamed_mode(monkeypatch, rec, **kw):
    from megamoe_rt.modes import stream_pool
    from megamoe_rt.runtime.deadlines import TimeoutRecord
    from megamoe_rt.schedule.streaming import StreamConfig

    record = TimeoutRecord.__new__(TimeoutRecord)  # the deadline record without host memory
    record.device_ptr = 0
    monkeypatch.setattr(TimeoutRecord, "_instance", record)
    spec = _spec(cap=1000, streaming=StreamConfig(3, 100), sm_count=132, **kw)
    mode = _mode(UnfusedMode, spec)
    pool = mode._stream_pool
    assert pool is not None, "one rank with a full pool streams through the call-wide pool"
    pool._kernels = {n: rec.kernel(n) for n in ("consume", "seal", "combine")}
    ring = mode.input_ring
    monkeypatch.setattr(ring, "_launch", lambda name, params, stream, grid=1: rec.log.append((name, params, stream)))
    monkeypatch.setattr(ring, "note_consumer", lambda stream: rec.log.append(("note_consumer", None, stream)))
    monkeypatch.setattr(
        stream_pool.streams,
        "memset_d32_async",
        lambda ptr, v, n, stream: rec.log.append(("memset", (ptr, v, n), stream)),
    )
    return mode, pool


def test_a_streamed_call_is_one_consumer_launch_then_one_seal_and_each_gemm_once(monkeypatch):
    from megamoe_rt.modes.stream_pool import consume_grid

    rec = _Recorder()
    mode, pool = _streamed_mode(monkeypatch, rec)
    b, lay = mode.buffer, mode.layout
    gemms = (rec.plan("l1"), rec.plan("l2"))
    # 250 tokens in chunks of 100 with a bound of 400: the launch walks 4 chunks (the device
    # stops at the call's last token); the host launches nothing per chunk.
    pool.run(mode, _call(t=250, bound=400), gemms, stream=7)
    names = [e[0] for e in rec.log]
    assert names == ["memset"] * 4 + ["stream_begin_consume", "consume", "seal", "l1", "l2", "combine", "note_consumer"]
    assert all(e[2] == 7 for e in rec.log)
    el, bpe = 16, -(-lay.num_max_tokens_per_rank // 128)
    assert [e[1] for e in rec.log[:4]] == [
        (b.ptr("expert_recv_counts"), 0, el),
        (b.ptr("stream_blocks_claimed"), 0, 1),
        (b.ptr("stream_expert_blocks"), 0, el * bpe),
        (b.ptr("stream_slot_done"), 0, 3),
    ]
    consume = rec.log[names.index("consume")][1]
    assert (consume.num_chunks, consume.slot_done) == (4, b.ptr("stream_slot_done"))
    assert bytes(consume.ring) == bytes(mode.input_ring.descriptor)
    assert (consume.pool.blocks_per_expert, consume.pool.pool_blocks) == (bpe, lay.pool_blocks)
    assert (consume.pool.block_map, consume.pool.call_topk_idx) == (
        b.ptr("stream_block_map"),
        b.ptr("stream_call_topk_idx"),
    )
    seal = rec.log[names.index("seal")][1]
    combine = rec.log[names.index("combine")][1]
    for p in (consume.pool.moe, seal.moe, combine):  # the whole call: its tokens, the ids the consumer keeps
        assert (p.num_tokens, p.token_base, p.topk_idx, p.y) == (250, 0, b.ptr("stream_call_topk_idx"), 0x5000)
    assert [e[1] for e in rec.log if e[0] in ("l1", "l2")] == [b.ptr("stream_block_map")] * 2
    assert consume.chunk_groups == 3  # one group per slot
    # One block an SM at most, no more blocks than the call's pairs need; a group per slot, at
    # most one per chunk and per block, the grid a multiple of the groups.
    assert consume_grid(132, 250 * 6, 4, 16) == (132, 4) and consume_grid(132, 20, 4, 16) == (3, 3)
    assert consume_grid(1, 10**6, 4, 16) == (1, 1) and consume_grid(132, 10**6, 16, 3) == (132, 3)
    assert consume_grid(132, 10**6, 1, 16) == (132, 1) and consume_grid(132, 10**6, 5, 16) == (130, 5)


def test_the_streamed_consumer_keeps_its_sms_open_to_producer_blocks_with_shared_memory(monkeypatch):
    # A consumer block on every SM, using no shared memory, let the driver give those SMs the
    # least shared memory: the producer's blocks then fit on none of them, and the call hangs.
    from megamoe_rt.modes import stream_pool

    rec = _Recorder()
    _, pool = _streamed_mode(monkeypatch, rec)
    asked = []

    class Loaded:
        def __init__(self, name):
            self.name = name

        def prefer_max_shared_memory(self):
            asked.append(self.name)

    monkeypatch.setattr(stream_pool, "get_kernel", lambda spec, dev: Loaded(spec.name))
    pool._kernels = {}
    pool.load_kernels()
    assert asked == ["moe_stream_consume"]
    assert set(pool._kernels) == {"consume", "seal", "combine"}


def test_a_streamed_call_without_tokens_only_keeps_the_rings_epoch(monkeypatch):
    rec = _Recorder()
    mode, pool = _streamed_mode(monkeypatch, rec)
    pool.run(mode, _call(t=0, bound=300), (rec.plan("l1"), rec.plan("l2")), stream=3)
    assert [e[0] for e in rec.log] == ["memset"] * 4 + ["stream_begin_consume", "note_consumer"]


def test_a_ring_pool_or_expert_parallel_layer_streams_chunk_by_chunk(monkeypatch):
    from megamoe_rt.schedule.streaming import StreamConfig

    spec = _spec(cap=1000, streaming=StreamConfig(3, 100))
    assert _mode(UnfusedMode, spec, ring_blocks=8)._stream_pool is None
    monkeypatch.setattr(base, "write_peer_table", lambda buffer: None)
    assert _mode(UnfusedMode, _spec(cap=1000, streaming=StreamConfig(3, 100), num_ranks=2))._stream_pool is None
