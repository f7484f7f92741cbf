"""The scale-out traffic model (`megamoe-rt scaleout`): its arithmetic on a layer small enough
to count by hand, its rank-hit probability against sampled routings, and the command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megamoe_rt.ep.scaleout_model import rank_miss_probability, scaleout_cost
from megamoe_rt.presets import Preset, get_preset


def test_a_small_layer_counted_by_hand():
    # H = I = 128, E = 4, K = 2 over 2 ranks, 10 tokens a rank: half of the 20 pairs are remote.
    tiny = Preset("tiny", 128, 128, 4, 2)
    c = scaleout_cost(tiny, 2, 10, link_bytes_per_s=1e9, tflops=1.0)
    assert c.dispatch_bytes == pytest.approx(10 * (128 + 4 + 8))  # row, one scale, send-list entry
    assert c.combine_bytes == pytest.approx(10 * 256)  # bf16 partials
    # A token misses the other rank's two experts with probability C(2,2)/C(4,2) = 1/6.
    assert c.dispatch_dedup_bytes == pytest.approx(10 * 5 / 6 * 132 + 10 * 8)
    assert c.comm_floor_us == pytest.approx((1400 + 2560) / 1e9 * 1e6)
    flops = 2 * 20 * 128 * 256 + 2 * 20 * 128 * 128
    assert c.gemm_us == pytest.approx(flops / 1e12 * 1e6)
    assert c.weight_read_us == pytest.approx(2 * (3 * 128 * 128 + 3 * 4) / 4.3e12 * 1e6)


@pytest.mark.parametrize("experts,topk,ranks", [(256, 8, 16), (384, 6, 32), (16, 4, 4)])
def test_the_rank_miss_probability_matches_sampled_routings(experts, topk, ranks):
    rng = np.random.default_rng(7)
    tokens = 20000
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk]  # distinct experts per token
    ranks_hit = np.zeros((tokens, ranks), dtype=bool)
    np.put_along_axis(ranks_hit, picks // (experts // ranks), True, axis=1)
    sampled = 1.0 - ranks_hit.mean()
    assert rank_miss_probability(experts, topk, ranks) == pytest.approx(sampled, abs=0.01)


def test_the_floor_scales_with_the_link_and_the_layer_with_the_rate():
    flash = get_preset("flash")
    ib = scaleout_cost(flash, 16, 2048)
    nvl = scaleout_cost(flash, 16, 2048, link_bytes_per_s=8 * 50e9)
    assert ib.comm_floor_us == pytest.approx(8 * nvl.comm_floor_us)
    assert scaleout_cost(flash, 16, 2048, tflops=390.0).gemm_us == pytest.approx(2 * ib.gemm_us)
    assert ib.dispatch_dedup_bytes < ib.dispatch_bytes
    with pytest.raises(ValueError, match="num_ranks"):
        scaleout_cost(flash, 7, 2048)


def test_the_command_prints_and_writes_rows(tmp_path, capsys):
    from megamoe_rt.cli.main import main

    out = tmp_path / "s.json"
    assert main(["scaleout", "--preset", "v3", "--ranks", "16,32", "--tokens", "8192", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| v3 | 16 | 8192 |" in text and "| v3 | 32 | 8192 |" in text
    rows = json.loads(out.read_text())
    assert [(r["num_ranks"], r["tokens"]) for r in rows] == [(16, 8192), (32, 8192)]
    assert all(r["comm_over_layer"] > 1 for r in rows)  # over 400 Gb/s the transfers outlast the GEMMs
    assert main(["scaleout", "--preset", "v3", "--ranks", "7"]) == 2
