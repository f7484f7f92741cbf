"""``bench prefill`` across launched ranks without a GPU: its options, its rows from every
rank's times, and a run on spawned ranks with the GPU parts stood in for, whose cross-rank
calls must be the same on every rank."""

from __future__ import annotations

import json

import pytest

from megamoe_rt.cli.bench_ep import ep_arguments
from megamoe_rt.cli.bench_prefill import EP_TOKENS, MODES, RATIOS, RingSize, format_row, prefill_rows
from megamoe_rt.ep.launch import spawn
from tests.helpers import bench_ranks


def test_prefill_across_ranks_takes_the_one_gpu_options_with_its_own_tokens():
    a = ep_arguments(["--presets", "flash,pro", "-o", "p.json", "--png", "p.png"], "prefill")
    assert (a.presets, a.tokens, a.mode, a.ratios) == (["flash", "pro"], EP_TOKENS, MODES, RATIOS)
    assert EP_TOKENS == [16384, 32768]
    assert (a.output, a.json, a.png) == ("p.json", False, "p.png")
    a = ep_arguments(["--preset", "v3", "--tokens", "16384", "--mode", "split", "--ratios", "0.25"], "prefill")
    assert (a.presets, a.tokens, a.mode, a.ratios) == (["v3"], [16384], ["split"], [0.25])
    # The layer benchmark keeps its own defaults.
    a = ep_arguments([], "moe")
    assert (a.presets, a.tokens, a.mode) == (["flash"], [64, 256, 2048, 8192], ["unfused"])


def test_bench_module_runs_prefill_across_ranks_under_a_launch(monkeypatch):
    import megamoe_rt.cli.bench_ep as bench_ep
    import megamoe_rt.ep.launch as launch
    from megamoe_rt.cli.bench import main

    calls = []
    monkeypatch.setattr(launch, "launched", lambda: True)
    monkeypatch.setattr(bench_ep, "main_ep", lambda argv, what: calls.append((what, argv)) or 0)
    assert main(["prefill", "--presets", "flash,pro", "--tokens", "16384"]) == 0
    assert calls == [("prefill", ["--presets", "flash,pro", "--tokens", "16384"])]


def _times(us: float) -> dict:
    return {"median_us": us, "band_us": [us - 1, us + 1], "rounds_us": [us, us]}


SIZES = {"1.0": RingSize(800, 8 << 20, 20 << 20), "0.25": RingSize(200, 2 << 20, 14 << 20)}


def test_prefill_rows_across_ranks_report_the_slowest_rank():
    # Rank 1 is the slower at the full pool, rank 0 on the ring.
    everyone = [{"1.0": _times(100.0), "0.25": _times(130.0)}, {"1.0": _times(120.0), "0.25": _times(110.0)}]
    full, ring = prefill_rows("flash", 16384, "unfused", SIZES, everyone)
    assert (full["ranks"], full["ring"], ring["ring"]) == (2, "1.0", "0.25")
    assert (full["median_us"], full["median_us_per_rank"], full["band_us"]) == (120.0, [100.0, 120.0], [119.0, 121.0])
    assert (ring["median_us"], ring["median_us_per_rank"], ring["rounds_us"]) == (130.0, [130.0, 110.0], [130.0] * 2)
    assert ring["time_vs_full"] == pytest.approx(130 / 120)
    assert (ring["ring_blocks"], ring["full_pool_blocks"]) == (200, 800)
    assert (ring["pool_mib"], ring["buffer_mib"]) == (2.0, 14.0)
    assert (ring["pool_vs_full"], ring["buffer_vs_full"]) == (0.25, 0.7)
    assert "EP2" in format_row(ring) and "x1.083" in format_row(ring)
    # One GPU: the same columns, one rank.
    one = prefill_rows("flash", 16384, "unfused", SIZES, everyone[:1])
    assert [list(r) for r in one] == [list(full), list(ring)]
    assert one[0]["ranks"] == 1 and one[1]["time_vs_full"] == 1.3 and "EP" not in format_row(one[1])


def test_prefill_on_spawned_ranks_makes_the_same_cross_rank_calls_and_rank_0_writes(tmp_path):
    (rows0, log0), (rows1, log1) = spawn(bench_ranks.prefill_rank, 2, args=(str(tmp_path),), timeout=120)
    assert log0 == log1  # else a real run hangs
    # Per (tokens, mode): its layers built, one exchange per rank, a barrier, its layers closed.
    unfused = [("layer", "unfused", r, 64, 1024) for r in (1.0, 0.5, 0.25)]
    assert log0[:9] == [*unfused, ("broadcast", "bench-prefill", 0), ("broadcast", "bench-prefill", 1)] + [
        ("barrier",),
        *[("close",)] * 3,
    ]
    assert rows0 == rows1 and len(rows0) == 2 * (3 + 4)
    assert {r["ranks"] for r in rows0} == {2}
    full, half = rows0[0], rows0[1]
    assert (full["median_us"], full["median_us_per_rank"]) == (1100.0, [1000.0, 1100.0])
    assert (half["median_us"], half["time_vs_full"]) == (1300.0, pytest.approx(1300 / 1100))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]
    assert json.loads((tmp_path / "rank0.json").read_text()) == rows0


def test_a_cell_has_a_row_per_ring_and_per_token_window_shorter_than_the_call():
    from megamoe_rt.cli.bench_prefill import _layer_kwargs, _rings
    from megamoe_rt.modes.base import LayerSpec

    spec = LayerSpec(4096, 2048, 32, 6, 65536)
    keys = _rings("fused", [0.25], spec, [16384, 65536, 131072])
    assert keys == ["1.0", "0.25", "default", "window 16384"]  # windows at or past the call: no row
    assert [_layer_kwargs(k) for k in keys] == [
        {"chunk_ratio": 1.0},
        {"chunk_ratio": 0.25},
        {},
        {"token_window": 16384},
    ]
    assert _rings("unfused", [0.5], spec, [8192]) == ["1.0", "0.5", "window 8192"]
    a = ep_arguments(["--windows", "8192,16384"], "prefill")
    assert a.windows == [8192, 16384]
