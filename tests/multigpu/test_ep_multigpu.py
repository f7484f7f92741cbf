"""MegaMoE across two ranks (expert parallelism over NVLink) against the single-process
reference of the same global problem (needs two Hopper GPUs and nvshmem4py).

Every rank draws the same global weights from a shared seed and loads its own experts; its
tokens and routing are its own. A token's output depends only on its routing and the
weights, so each rank checks its own outputs against the reference of the global layer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from megamoe_rt.ep.launch import RankFailed, spawn
from tests.conftest import TEST_RANKS as WORLD
from tests.helpers.layer_calls import BF16_NAN, replay_captured

pytestmark = pytest.mark.multigpu

# Each rank owns 8 experts (how many ranks: TEST_RANKS in tests/conftest.py).
H, I, E, K = 512, 256, 8 * WORLD, 4


def _inputs(rank, tokens, routing, seed, weight_seed):
    from megamoe_rt import reference as ref

    weights = ref.random_moe_inputs(np.random.default_rng(weight_seed), 1, H, I, E, K)
    rng = np.random.default_rng(seed * 100 + rank)
    inp = ref.random_moe_inputs(rng, tokens, H, I, E, K, empty_slot_prob=0.15)
    if routing == "to_peer":  # every slot on the next rank's experts
        el = E // WORLD
        other = (rank + 1) % WORLD * el
        inp["topk_idx"] = np.stack([rng.permutation(el)[:K] + other for _ in range(tokens)]).astype(np.int32)
    for name in ("w1", "w1_sf", "w2", "w2_sf"):
        inp[name] = weights[name]
    return inp


def _run_rank(ctx, tokens_per_rank, routing, launches, graph, seed, mode):
    import cupy as cp

    from megamoe_rt import MegaMoE
    from megamoe_rt import reference as ref

    cp.cuda.Device(ctx.device).use()
    capacity = max(max(tokens_per_rank), 1)
    layer = MegaMoE(H, I, E, K, capacity, mode=mode, group=ctx, track_expert_stats=True, debug=True)
    el = E // ctx.world_size
    t = tokens_per_rank[ctx.rank]
    diffs = []
    for n in range(launches):
        inp = _inputs(ctx.rank, t, routing, seed + n, weight_seed=seed)  # the weights loaded at n == 0
        if n == 0:
            local = slice(ctx.rank * el, (ctx.rank + 1) * el)
            layer.load_weights(inp["w1"][local], inp["w1_sf"][local], inp["w2"][local], inp["w2_sf"][local])
        x = cp.asarray(inp["x"].view(np.uint8))
        args = (x, cp.asarray(inp["x_sf"]), cp.asarray(inp["topk_idx"]), cp.asarray(inp["topk_weights"]))
        out = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
        if graph and n == 1:
            replay_captured(layer, args, out)
        else:
            layer(*args, out=out)
        got = (cp.asnumpy(out).astype(np.uint32) << 16).view(np.float32)
        if t:
            sample = slice(0, min(t, 48))
            exp = ref.moe_forward(
                inp["x"][sample],
                inp["x_sf"][sample],
                inp["topk_idx"][sample],
                inp["topk_weights"][sample],
                inp["w1"],
                inp["w1_sf"],
                inp["w2"],
                inp["w2_sf"],
            )
            diffs.append(float(ref.calc_diff(got[sample], exp.astype(np.float32))))
            assert np.isfinite(got).all()
            empty = (inp["topk_idx"] < 0).all(axis=1)
            assert (got[empty] == 0).all()
    stats = cp.asnumpy(layer.expert_recv_stats).tolist()
    ctx.barrier()
    layer.close()
    from megamoe_rt.ep.symm import NvshmemRuntime

    NvshmemRuntime.initialize(ctx).finalize()
    return diffs, stats


def _tokens(*first_two):
    """Tokens per rank: the two given, then a pattern for further ranks."""
    return tuple(first_two) + tuple(40 + 17 * r for r in range(2, WORLD))


MODES = ["unfused", "fused", "split"]


def rank_call_inputs(ctx, tokens_per_rank, seed):
    """This rank's random routing of its tokens as device arrays (x, x_sf, ids, weights), the
    host inputs they came from and the slice of the global experts it owns."""
    import cupy as cp

    cp.cuda.Device(ctx.device).use()
    el = E // ctx.world_size
    inp = _inputs(ctx.rank, tokens_per_rank[ctx.rank], "random", seed, weight_seed=seed)
    args = (
        cp.asarray(inp["x"].view(np.uint8)),
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
    )
    return args, inp, slice(ctx.rank * el, (ctx.rank + 1) * el)


def _modes_bitwise_rank(ctx, tokens_per_rank, seed):
    """Every mode on this rank's inputs; their outputs."""
    import cupy as cp

    from megamoe_rt import MegaMoE

    args, inp, local = rank_call_inputs(ctx, tokens_per_rank, seed)
    t = tokens_per_rank[ctx.rank]
    outs = {}
    for mode in MODES:
        layer = MegaMoE(H, I, E, K, max(tokens_per_rank), mode=mode, group=ctx)
        layer.load_weights(inp["w1"][local], inp["w1_sf"][local], inp["w2"][local], inp["w2_sf"][local])
        for _ in range(3):  # repeated calls: launch parity and the split graph's replays
            out = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
            layer(*args, out=out)
        outs[mode] = cp.asnumpy(out)
        ctx.barrier()
        layer.close()
    from megamoe_rt.ep.symm import NvshmemRuntime

    NvshmemRuntime.initialize(ctx).finalize()
    return outs


def test_ep_modes_agree_bitwise():
    for outs in spawn(_modes_bitwise_rank, WORLD, args=(_tokens(300, 111), 5), timeout=900):
        np.testing.assert_array_equal(outs["split"], outs["fused"])
        np.testing.assert_array_equal(outs["split"], outs["unfused"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "tokens,routing",
    [(_tokens(200, 77), "random"), (_tokens(150, 0), "random"), (_tokens(64, 96), "to_peer")],
    ids=["uneven", "one_rank_empty", "all_to_peer"],
)
def test_ep_matches_the_reference(tokens, routing, mode):
    results = spawn(_run_rank, WORLD, args=(tokens, routing, 2, False, 7, mode), timeout=600)
    for diffs, _ in results:
        assert all(d < 1e-3 for d in diffs), diffs


@pytest.mark.parametrize("mode", MODES)
def test_ep_twenty_back_to_back_launches_and_a_graph_replay(mode):
    results = spawn(_run_rank, WORLD, args=(_tokens(128, 100), "random", 20, True, 11, mode), timeout=900)
    for diffs, stats in results:
        assert len(diffs) == 20 and max(diffs) < 1e-3, diffs
        assert sum(stats) > 0


def _silent_rank(ctx, mode):
    """The last rank never calls the layer; the others must fail at the call's exchange, on
    the host, naming it (no kernel launched, no trap, the context alive)."""
    import cupy as cp

    from megamoe_rt import MegaMoE

    cp.cuda.Device(ctx.device).use()
    layer = MegaMoE(H, I, E, K, 64, mode=mode, group=ctx, timeout_s=1.0)
    inp = _inputs(ctx.rank, 64, "random", 3, weight_seed=3)
    el = E // ctx.world_size
    local = slice(ctx.rank * el, (ctx.rank + 1) * el)
    layer.load_weights(inp["w1"][local], inp["w1_sf"][local], inp["w2"][local], inp["w2_sf"][local])
    if ctx.rank == ctx.world_size - 1:
        time.sleep(60)  # alive, buffer mapped, never calling; stopped by the launcher
        return None
    try:
        layer(
            cp.asarray(inp["x"].view(np.uint8)),
            cp.asarray(inp["x_sf"]),
            cp.asarray(inp["topk_idx"]),
            cp.asarray(inp["topk_weights"]),
        )
    except TimeoutError:
        cp.cuda.Device().synchronize()  # nothing was launched: the context is fine
        raise
    return None


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_never_calls_fails_its_peers_on_the_host_naming_it(mode, monkeypatch):
    monkeypatch.setenv("MEGAMOE_RT_HUB_TIMEOUT_S", "5")
    with pytest.raises(RankFailed) as info:
        spawn(_silent_rank, WORLD, args=(mode,), timeout=300)
    text = str(info.value)
    assert "TimeoutError" in text and f"rank {WORLD - 1} did not take part" in text, text


def test_trace_across_ranks_writes_a_process_per_rank(tmp_path):
    path = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "megamoe_rt", "launch", "-n", str(WORLD), "-m", "megamoe_rt.cli.trace"]
    cmd += ["--tokens", "256", "-o", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {s["pid"] for s in spans} == set(range(WORLD))
    assert all(s["dur"] >= 0 for s in spans)
