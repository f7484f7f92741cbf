"""The fused mode's streamed calls on the host: the claim state's one region, the launch's
parameters and grid, and what a call enqueues (the device side: tests/gpu/test_stream_gpu.py)."""

from __future__ import annotations

import ctypes

import pytest

from megamoe_rt.kernels import fused as fk
from megamoe_rt.modes.fused import FusedMode
from megamoe_rt.modes.fused_stream import StreamedFusedCall, streamed_lag
from megamoe_rt.modes.registry import select_mode
from megamoe_rt.schedule.layout import stream_blocks_per_expert, streamed_claim_words
from megamoe_rt.schedule.streaming import StreamConfig
from tests.cpu.test_modes import _call, _mode, _spec

RING = StreamConfig(3, 100)


def _streamed(cfg=RING, **kw):
    spec = _spec(cap=1000, streaming=cfg, sm_count=132, **kw)
    mode = _mode(FusedMode, spec)
    return mode, StreamedFusedCall(spec, mode.layout, mode.buffer)


def test_a_streamed_layer_holds_the_full_pool():
    mode, _ = _streamed()
    assert mode.layout.pool == "full" and mode.layout.pool_blocks == mode.layout.full_pool_blocks
    for option in ("ring_blocks", "chunk_ratio"):
        with pytest.raises(ValueError, match=f"{option}=.*: a streamed layer in mode='fused' holds the full pool"):
            select_mode("fused", mode.spec, **{option: 8 if option == "ring_blocks" else 0.5})
        # The default streams over a ring in the unfused mode, as before.
        assert select_mode(None, mode.spec, **{option: 8 if option == "ring_blocks" else 0.5}).name == "unfused"


def test_the_default_streams_in_the_unfused_mode_until_the_fused_role_has_passed_on_a_gpu():
    mode, _ = _streamed()
    assert select_mode(None, mode.spec).name == "unfused"
    assert select_mode("fused", mode.spec).name == "fused"
    assert select_mode(None, _spec(cap=1000, sm_count=132)).name == "fused"  # batch layers: unchanged


def test_the_claim_state_is_one_region_of_disjoint_parts():
    mode, call = _streamed()
    b, lay = mode.buffer, mode.layout
    region = lay.workspace_region("stream_claim_words")
    base = b.ptr("stream_claim_words")
    pool = call.pool(mode.input_ring, 250)
    parts = {
        "expert_counts": pool.expert_counts,
        "expert_blocks": pool.expert_blocks,
        "blocks_claimed": pool.blocks_claimed,
        "slot_done": pool.slot_done,
        "parts_done": pool.parts_done,
        "state": pool.ready.state,
        "ready": pool.ready.ready,
        "ready_count": pool.ready.ready_count,
        "sealed": pool.ready.sealed,
    }
    bpe = stream_blocks_per_expert(lay.num_max_tokens_per_rank, 1, lay.block_m)
    words = streamed_claim_words(16, bpe, 3, lay.full_pool_blocks)
    assert list(words) == list(parts)  # the region's order is the struct's
    spans = sorted((parts[n], parts[n] + 4 * words[n]) for n in parts)
    assert spans[0][0] == base and spans[-1][1] == base + region.nbytes  # the memset covers exactly these
    assert all(a[1] == b_[0] for a, b_ in zip(spans, spans[1:]))  # packed, none overlapping
    assert pool.block_expert == b.ptr("stream_block_expert") and pool.call_topk_idx == b.ptr("stream_call_topk_idx")
    assert (pool.blocks_per_expert, pool.num_chunks, pool.lag) == (bpe, 3, call.lag)
    assert bytes(pool.ring) == bytes(mode.input_ring.descriptor)


def test_the_launch_leaves_the_producer_its_sms():
    assert StreamConfig(2, 64).consumer_sms(132) == 132 - 16
    assert StreamConfig(2, 64, producer_sms=4).consumer_sms(132) == 128
    assert StreamConfig(2, 64).consumer_sms(4) == 3  # at least one SM for the producer
    with pytest.raises(ValueError, match="producer_sms=132: expected fewer than the GPU's 132 SMs"):
        StreamConfig(2, 64, producer_sms=132).consumer_sms(132)
    with pytest.raises(ValueError, match="producer_sms"):
        StreamConfig(2, 64, producer_sms=0)
    _, call = _streamed(StreamConfig(3, 100, producer_sms=12))
    assert call.grid == 120


def test_the_lag_spans_about_two_grids_of_tiles():
    assert streamed_lag(116, 16, 16) == 8  # 2 * 116 tiles over positions of 32 tiles
    assert streamed_lag(1, 64, 64) == 1
    for grid, n1, n2 in [(116, 4, 2), (64, 12, 28), (132, 56, 28)]:
        lag = streamed_lag(grid, n1, n2)
        assert lag * (n1 + n2) >= 2 * grid > (lag - 1) * (n1 + n2)


def test_layers_wider_than_the_tile_word_are_refused():
    spec = _spec(h=256 * 65, i=256, cap=1000, streaming=StreamConfig(3, 100), sm_count=132)
    assert "mode='fused' streams layers of at most 64" in FusedMode.refusal(spec)
    with pytest.raises(ValueError, match="mode='fused' streams layers of at most 64"):
        select_mode("fused", spec)
    assert FusedMode.refusal(_spec(h=256 * 64, i=256 * 32, cap=1000, streaming=RING, sm_count=132)) is None


def test_a_producer_that_would_take_every_sm_is_refused_when_the_mode_is_built():
    spec = _spec(cap=1000, streaming=StreamConfig(3, 100, producer_sms=132), sm_count=132)
    with pytest.raises(ValueError, match="producer_sms=132: expected fewer than the GPU's 132 SMs"):
        _mode(FusedMode, spec)


class _Plan:
    def __init__(self, log):
        self.log = log

    def params(self, moe, schedule, *, timeout_s=None):
        return fk.FusedParams(moe=moe, lag_units=schedule.lag_units, withhold_block=fk.NO_BLOCK)

    def launch(self, idx, params, stream, *, programmatic=False, role="fused", grid=None, cooperative=True):
        self.log.append(("launch", (idx, role, grid, params, cooperative), stream))


def _recording(monkeypatch, **kw):
    from megamoe_rt.modes import fused_stream
    from megamoe_rt.runtime.deadlines import TimeoutRecord

    record = TimeoutRecord.__new__(TimeoutRecord)  # the deadline record without host memory
    record.device_ptr = 0
    monkeypatch.setattr(TimeoutRecord, "_instance", record)
    log = []
    mode, call = _streamed(**kw)
    mode.plan, mode.streamed = _Plan(log), call
    ring = mode.input_ring
    monkeypatch.setattr(ring, "load_kernels", lambda: None)
    monkeypatch.setattr(ring, "_launch", lambda name, params, stream, grid=1: log.append((name, None, stream)))
    monkeypatch.setattr(ring, "note_consumer", lambda stream: log.append(("note_consumer", None, stream)))
    monkeypatch.setattr(
        fused_stream.streams, "memset_d32_async", lambda ptr, v, n, stream: log.append(("memset", (ptr, v, n), stream))
    )
    return mode, call, log


def test_a_streamed_call_is_one_memset_and_one_launch(monkeypatch):
    mode, call, log = _recording(monkeypatch)
    b = mode.buffer
    mode.run_streamed(_call(t=250, bound=400), 7)
    assert [e[0] for e in log] == ["memset", "stream_begin_consume", "launch", "note_consumer"]
    assert all(e[2] == 7 for e in log)
    region = mode.layout.workspace_region("stream_claim_words")
    assert log[0][1] == (b.ptr("stream_claim_words"), 0, region.nbytes // 4)
    idx, role, grid, params, cooperative = log[2][1]
    # One block an SM on fewer blocks than SMs; not cooperative, so the producer's kernels run beside it.
    assert (idx, role, grid, cooperative) == ("int32", "streamed", 132 - 16, False)
    m = params.moe
    # The kernel's MoE view: no inputs of its own, the ids the dispatch keeps, the caller's y.
    assert (m.num_tokens, m.x, m.x_sf, m.topk_idx, m.y) == (250, 0, 0, b.ptr("stream_call_topk_idx"), 0x5000)
    assert params.streamed.num_chunks == 3  # the call's tokens, not the bound
    assert ctypes.sizeof(params) == ctypes.sizeof(fk.FusedParams)


def test_a_streamed_call_without_tokens_only_keeps_the_rings_epoch(monkeypatch):
    mode, _, log = _recording(monkeypatch)
    mode.run_streamed(_call(t=0, bound=300), 3)
    assert [e[0] for e in log] == ["memset", "stream_begin_consume", "note_consumer"]


def test_the_registry_names_the_modes_whose_kernel_streams():
    from megamoe_rt.modes.registry import KERNEL_STREAMING, MODES

    spec = _spec(cap=1000, streaming=RING, sm_count=132)
    assert [n for n in MODES if MODES[n].refusal(spec) is None and not MODES[n].streams_over_ring] == list(
        KERNEL_STREAMING
    )
