"""``bench stream`` across launched ranks without a GPU: its options, its dispatch, its rows
from every rank's times, and runs on spawned ranks with the GPU parts stood in for, whose
cross-rank calls must be the same on every rank."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from megamoe_rt.cli.bench_ep import ep_arguments
from megamoe_rt.cli.bench_stream import PRESETS, TOKENS, format_row, stream_rows
from megamoe_rt.ep.launch import spawn
from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset
from megamoe_rt.schedule.streaming import StreamConfig
from tests.helpers import bench_ranks


def test_stream_across_ranks_takes_the_one_gpu_options():
    a = ep_arguments([], "stream")
    assert (a.presets, a.tokens, a.slots, a.chunk, a.output, a.json) == (PRESETS, TOKENS, 4, 512, None, False)
    assert (PRESETS, TOKENS) == (["flash", "v3"], [512, 2048, 8192])
    argv = ["--presets", "flash,v3", "--tokens", "512,2048,8192", "--slots", "3", "--chunk", "256", "-o", "s.json"]
    a = ep_arguments(argv, "stream")
    assert (a.presets, a.tokens, a.slots, a.chunk, a.output) == (["flash", "v3"], [512, 2048, 8192], 3, 256, "s.json")
    with pytest.raises(SystemExit):
        ep_arguments(["--chunk", "0"], "stream")
    # The other benchmarks keep their own defaults.
    a = ep_arguments([], "moe")
    assert (a.presets, a.tokens) == (["flash"], [64, 256, 2048, 8192])


def test_bench_module_runs_stream_across_ranks_under_a_launch(monkeypatch):
    import megamoe_rt.cli.bench_ep as bench_ep
    import megamoe_rt.ep.launch as launch
    from megamoe_rt.cli.bench import main

    calls = []
    monkeypatch.setattr(launch, "launched", lambda: True)
    monkeypatch.setattr(bench_ep, "main_ep", lambda argv, what: calls.append((what, argv)) or 0)
    argv = ["--presets", "flash,v3", "--tokens", "512,2048,8192", "-o", "s.json"]
    assert main(["stream", *argv]) == 0
    assert calls == [("stream", argv)]


@pytest.mark.parametrize("shared", [False, True])
def test_main_ep_runs_the_one_gpu_benchmark_with_the_rank_group(monkeypatch, capsys, tmp_path, shared):
    import cuda.core

    import megamoe_rt.cli.bench_ep as bench_ep
    import megamoe_rt.cli.bench_stream as bench_stream
    import megamoe_rt.ep.launch as launch
    import megamoe_rt.ep.symm as symm

    # The peer runs on the same GPU (its uuid is ours) or on another one.
    peer = SimpleNamespace(uuid="GPU-1" if shared else "GPU-2")
    monkeypatch.setattr(cuda.core, "Device", lambda d: SimpleNamespace(uuid=f"GPU-{d}"))
    ctx = SimpleNamespace(device=1, rank=0, world_size=2, allgather=lambda v, key: [v, str(peer.uuid).encode()])
    seen: dict = {}
    finalized = []
    runtime = SimpleNamespace(finalize=lambda: finalized.append(True))
    monkeypatch.setitem(
        sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: SimpleNamespace(use=lambda: None)))
    )
    import megamoe_rt.requirements as requirements

    monkeypatch.setattr(launch, "context_from_env", lambda: ctx)
    # CuPy is stood in for below, so the stack check would not find it.
    monkeypatch.setattr(requirements, "gpu_or_report", lambda program, ordinal=None: SimpleNamespace())
    monkeypatch.setattr(symm.NvshmemRuntime, "initialize", classmethod(lambda cls, group: runtime))
    monkeypatch.setattr(
        bench_stream, "bench_stream", lambda presets, tokens, **kw: seen.update(kw, args=(presets, tokens))
    )
    out = str(tmp_path / "s.json")
    assert bench_ep.main_ep(["--slots", "2", "-o", out], what="stream") == 0
    assert seen["args"] == (PRESETS, TOKENS)
    assert (seen["slots"], seen["chunk"], seen["rounds"], seen["json_path"]) == (2, 512, 3, out)
    assert seen["group"] is ctx and finalized == [True]
    assert ("ranks share a GPU" in capsys.readouterr().err) == shared


def _arms(unfused: float, fused: float, streamed: float) -> dict:
    def times(us: float) -> dict:
        return {"median_us": us, "band_us": [us - 1, us + 1], "rounds_us": [us, us], "error": None}

    return {"sequential unfused": times(unfused), "sequential fused": times(fused), "streamed": times(streamed)}


DIFFERS = "the streamed call's output differs from the sequential call's"
CFG = StreamConfig(num_slots=4, tokens_per_slot=512)


def test_stream_rows_across_ranks_report_the_slowest_rank():
    # Rank 1 is the slower sequentially, rank 0 streamed; rank 1's streamed call differed.
    everyone = [{"arms": _arms(1000, 900, 800), "same": True}, {"arms": _arms(1100, 850, 750), "same": False}]
    unfused, fused, streamed = stream_rows("flash", 2048, CFG, everyone)
    assert [r["arm"] for r in (unfused, fused, streamed)] == ["sequential unfused", "sequential fused", "streamed"]
    assert {r["ranks"] for r in (unfused, fused, streamed)} == {2}
    assert (unfused["median_us"], unfused["median_us_per_rank"]) == (1100, [1000, 1100])
    assert unfused["band_us"] == [1099, 1101]
    assert (fused["median_us"], fused["median_us_per_rank"]) == (900, [900, 850])
    assert (streamed["median_us"], streamed["median_us_per_rank"]) == (800, [800, 750])
    assert streamed["vs_sequential_fused"] == pytest.approx(800 / 900)
    assert (streamed["chunks"], streamed["slots"], streamed["tokens_per_slot"]) == (4, 4, 512)
    assert not any(r["streamed_equals_sequential"] for r in (unfused, fused, streamed))
    assert "EP2" in format_row(streamed) and "slowest rank" in format_row(streamed) and "x0.889" in format_row(streamed)
    # One GPU: the same columns, one rank.
    one = stream_rows("flash", 2048, CFG, everyone[:1])
    assert [list(r) for r in one] == [list(unfused), list(fused), list(streamed)]
    assert one[2]["vs_sequential_fused"] == pytest.approx(800 / 900) and one[2]["streamed_equals_sequential"]
    assert "EP" not in format_row(one[2]) and "slowest" not in format_row(one[2])


def test_stream_rows_report_a_rank_whose_arm_failed():
    everyone = [{"arms": _arms(1000, 900, 800), "same": True}, {"arms": _arms(1100, 850, 750), "same": True}]
    everyone[0]["arms"]["sequential fused"] = {"median_us": float("nan"), "band_us": [0, 0], "error": "E: no"}
    fused = stream_rows("v3", 512, CFG, everyone)[1]
    assert fused["error"] == "E: no"


def _cell_log(local: int, t: int) -> list[tuple]:
    """What every rank does in one cell, in order: collectives, layer lifetimes, the producer."""
    experts = 2 * local
    return [
        ("layer", "streamed", None, experts, t),
        ("layer", "unfused", None, experts, t),
        ("layer", "fused", None, experts, t),
        ("router", experts),  # routes over every rank's experts
        ("warm",),  # before any layer call that waits
        ("call", "unfused", t),
        ("call", "fused", t),
        ("consume", t, t),  # enqueued before its producer
        ("produce",),
        ("consume", t, t),  # the check: the streamed call, then the batch call, on every rank
        ("produce",),
        ("call", "unfused", t),
        ("broadcast", "bench-stream", 0),
        ("broadcast", "bench-stream", 1),
        ("barrier",),
        *[("close",)] * 3,
    ]


def test_stream_on_spawned_ranks_makes_the_same_cross_rank_calls_and_rank_0_writes(tmp_path):
    (rows0, log0), (rows1, log1) = spawn(bench_ranks.stream_rank, 2, args=(str(tmp_path), None), timeout=120)
    assert log0 == log1  # else a real run hangs
    local = get_preset("flash").num_experts // DEFAULT_EP_RANKS
    assert log0 == _cell_log(local, 512) + _cell_log(local, 1024)
    assert rows0 == rows1 and len(rows0) == 2 * 3
    assert {r["ranks"] for r in rows0} == {2} and all(r["streamed_equals_sequential"] for r in rows0)
    unfused, fused, streamed = rows0[:3]
    assert (unfused["median_us"], fused["median_us"], streamed["median_us"]) == (1100.0, 900.0, 800.0)
    assert streamed["median_us_per_rank"] == bench_ranks.STREAM_US[0][2:] + bench_ranks.STREAM_US[1][2:]
    assert [(r["tokens_per_slot"], r["chunks"]) for r in rows0] == [(512, 1)] * 3 + [(768, 2)] * 3
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]
    assert json.loads((tmp_path / "rank0.json").read_text()) == rows0


def test_stream_on_spawned_ranks_raises_on_every_rank_when_one_rank_differs(tmp_path):
    (out0, log0), (out1, log1) = spawn(bench_ranks.stream_rank, 2, args=(str(tmp_path), 1), timeout=120)
    assert out0 == out1 == f"raised: flash T=512: {DIFFERS} on rank(s) [1]"
    assert log0 == log1 and log0[-4:] == [("barrier",), *[("close",)] * 3]  # the first cell ends, then all raise
    rows = json.loads((tmp_path / "rank0.json").read_text())  # what it measured is written first
    assert len(rows) == 3 and not any(r["streamed_equals_sequential"] for r in rows)
