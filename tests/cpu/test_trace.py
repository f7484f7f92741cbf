"""The stage trace's conversion to a Chrome / Perfetto trace file (synthetic stamps, no GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megamoe_rt.cli.trace import (
    ROLES,
    SPANS,
    TracedKernel,
    chrome_trace,
    kernels_of,
    l1_before_last_chunk_us,
    trace_events,
    wait_us_per_block,
)
from megamoe_rt.kernels.fused import TRACE_EVENTS, TRACE_TIMES, TRACE_WAITS

COL = {e: j for j, e in enumerate(TRACE_EVENTS)}


def _block(start_ns, sm, **offsets_us):
    """One trace row: ``start`` at start_ns, every other named event at start + offset (µs)."""
    row = np.zeros(len(TRACE_EVENTS), np.uint64)
    row[COL["start"]] = start_ns
    row[COL["sm"]] = sm
    for event, us in offsets_us.items():
        row[COL[event]] = start_ns + int(us * 1000)
    return row


FULL = dict(
    counted=2,
    claimed=5,
    dispatch_done=40,
    first_l1=12,
    producer_done=90,
    math_done=95,
    all_tiles_done=97,
    combine_done=110,
)


def _spans(events):
    return [e for e in events if e["ph"] == "X"]


def test_a_fused_block_gives_one_span_per_stage_on_its_sms_role_tracks():
    stamps = np.stack([_block(10_000, 5, **FULL), _block(10_500, 9, **FULL), np.zeros(len(TRACE_EVENTS), np.uint64)])
    events = trace_events(stamps, TRACE_EVENTS, kernels_of("fused", 3), rank=0, origin_ns=10_000)
    spans = _spans(events)
    # The third block never ran: nothing of it; a batch call has no last chunk.
    assert len(spans) == 2 * (len(SPANS) - 1)
    by_name = {(s["args"]["sm"], s["name"]): s for s in spans}
    gemm = by_name[(9, "GEMM tiles")]
    assert gemm["ts"] == pytest.approx(0.5 + 5) and gemm["dur"] == pytest.approx(90)
    assert by_name[(5, "count routes")]["ts"] == 0 and by_name[(5, "combine")]["dur"] == pytest.approx(13)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {names[s["tid"]] for s in spans if s["args"]["sm"] == 5} == {
        "SM   5 routing",
        "SM   5 dispatch warps",
        "SM   5 producer",
        "SM   5 math",
    }
    assert all(s["dur"] >= 0 and s["cat"] == "fused" for s in spans)
    assert {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}} in events


def test_missing_or_reversed_stamps_draw_no_span():
    row = _block(1_000, 2, counted=1, claimed=3, math_done=8)  # no dispatch/producer/combine stamps
    row[COL["all_tiles_done"]] = row[COL["math_done"]] - 1  # reversed: not drawn
    spans = _spans(trace_events(row[None], TRACE_EVENTS, kernels_of("fused", 1), rank=0, origin_ns=0))
    assert [s["name"] for s in spans] == ["count routes", "lay out and claim rows", "GEMM tiles"]


def test_split_rows_are_k1_then_k2_then_k3_and_k3_blocks_sharing_an_sm_get_a_track_each():
    k1 = _block(100, 1, counted=1, claimed=2, dispatch_done=10, producer_done=20, math_done=21)
    k2 = _block(200, 2, counted=1, claimed=2, producer_done=30, math_done=31)
    k3a = _block(31_000, 1, combine_done=4)
    k3b = _block(31_500, 1, combine_done=4)
    unused = np.zeros(len(TRACE_EVENTS), np.uint64)
    stamps = np.stack([k1, k2, k3a, k3b, unused])
    kernels = kernels_of("split", 5, (1, 1, 132))
    assert [(k.name, k.first_row, k.rows, k.reduce) for k in kernels] == [
        ("K1 dispatch+L1", 0, 1, False),
        ("K2 L2+scatter", 1, 1, False),
        ("K3 reduce", 2, 3, True),
    ]
    spans = _spans(trace_events(stamps, TRACE_EVENTS, kernels, rank=0, origin_ns=0))
    reduce = [s for s in spans if s["cat"] == "K3 reduce"]
    assert [s["name"] for s in reduce] == ["reduce (combine)"] * 2 and len({s["tid"] for s in reduce}) == 2
    assert {s["name"] for s in spans if s["cat"] == "K2 L2+scatter"} == {
        "count routes",
        "lay out and claim rows",
        "load tiles (TMA)",
        "GEMM tiles",
    }
    tids = {(s["args"]["sm"], s["name"]): s["tid"] for s in spans}
    assert tids[(1, "dispatch rows")] != tids[(1, "GEMM tiles")]  # one track per role
    assert len(ROLES) * 64 > max(tids.values()) % (len(ROLES) * 64)


def test_ranks_become_processes_on_one_time_axis_and_the_file_is_json():
    a = np.stack([_block(5_000_000, 0, **FULL)])
    b = np.stack([_block(5_002_000, 0, **FULL)])
    kernels = [TracedKernel("fused", 0, 1)]
    trace = chrome_trace([(0, a, kernels), (1, b, kernels)], TRACE_EVENTS, {"mode": "fused"})
    spans = _spans(trace["traceEvents"])
    starts = {s["pid"]: s["ts"] for s in spans if s["name"] == "count routes"}
    assert starts == {0: 0.0, 1: pytest.approx(2.0)}  # µs from the earliest stamp of any rank
    assert json.loads(json.dumps(trace))["otherData"] == {"mode": "fused"}


def test_only_the_traced_modes_and_a_split_with_its_sms_are_accepted():
    with pytest.raises(ValueError, match="mode='split': the SM split"):
        kernels_of("split", 10)
    with pytest.raises(ValueError, match="mode='unfused': a trace is recorded by mode 'fused' or 'split'"):
        kernels_of("unfused", 10)


def test_a_streamed_call_says_how_far_ahead_of_the_last_chunk_l1_started():
    # Block 0 starts L1 12 us in; block 1 sees the last chunk at 60 us, block 0 at 58 us.
    streamed = dict(FULL, last_chunk=58)
    stamps = np.stack([_block(10_000, 5, **streamed), _block(10_000, 9, **dict(streamed, first_l1=20, last_chunk=60))])
    assert l1_before_last_chunk_us(stamps, TRACE_EVENTS) == pytest.approx(60 - 12)
    spans = _spans(trace_events(stamps, TRACE_EVENTS, kernels_of("fused", 2), rank=0, origin_ns=10_000))
    arrive = [s for s in spans if s["name"] == "chunks arrive, to the last"]
    assert sorted(s["dur"] for s in arrive) == pytest.approx([58 - 5, 60 - 5])
    batch = np.stack([_block(10_000, 5, **FULL)])
    assert l1_before_last_chunk_us(batch, TRACE_EVENTS) is None


def test_a_streamed_trace_is_refused_outside_the_fused_mode_before_the_gpu_probe(capsys):
    from megamoe_rt.cli.main import main

    assert main(["trace", "--stream", "4x512", "--mode", "split", "--json"]) == 2
    assert "--stream: a streamed call is traced in --mode fused, not 'split'" in capsys.readouterr().err


def test_the_data_wait_sums_are_averaged_over_the_blocks_that_ran_and_kept_off_the_time_axis():
    assert TRACE_WAITS == ("wait_rows_ns", "wait_ring_ns", "wait_l1_out_ns", "wait_dispatch_ns")
    assert not set(TRACE_WAITS) & set(TRACE_TIMES)
    a, b = _block(10_000, 5, **FULL), _block(10_500, 9, **FULL)
    a[COL["wait_rows_ns"]], b[COL["wait_rows_ns"]] = 3_000, 5_000  # 3 and 5 us
    a[COL["wait_dispatch_ns"]] = 1  # a sum, never a time: below every stamp
    idle = np.zeros(len(TRACE_EVENTS), np.uint64)  # a block that did not run
    idle[COL["wait_l1_out_ns"]] = 10**9
    stamps = np.stack([a, b, idle])
    waits = wait_us_per_block(stamps, TRACE_EVENTS)
    assert waits == pytest.approx({"wait_rows": 4.0, "wait_ring": 0.0, "wait_l1_out": 0.0, "wait_dispatch": 0.0005})
    trace = chrome_trace([(0, stamps, kernels_of("fused", 3))], TRACE_EVENTS, {})
    first = min(s["ts"] for s in _spans(trace["traceEvents"]))
    assert first == 0.0  # the origin is the earliest stamp (10 us), not the 1 ns sum
