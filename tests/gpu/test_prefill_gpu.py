"""Prefill-sized calls and ring pools on one GPU.

A ring changes where a pool row's data waits, never what is computed from it: every mode with a
ring (unfused in cycles, fused and split with per-slot waits) must give the bits of the full
pool. Long calls (16K-64K tokens at a flash-like EP8 slice) are checked between modes bit for
bit and, on a sample of tokens, against the reference (a token's output depends only on its
own row, so the reference of a few tokens is the reference of those rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.layer_calls import BF16_NAN, bf16, device_args, replay_with_new_inputs, run_poisoned

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BLOCK = 128  # the unfused pool's block rows


def _layer(h, i, e, k, cap, w, **kw):
    from megamoe_rt import MegaMoE

    layer = MegaMoE(h, i, e, k, cap, **kw)
    layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
    return layer


def _pool_cycles(layer):
    cp.cuda.runtime.deviceSynchronize()
    return int(layer.buffer.view("pool_cycles")[0])


def _expected_cycles(topk_idx, num_experts, ring_rows):
    """ceil(rows laid out / ring rows), at least 1: every expert's received rows padded to a block."""
    ids = np.asarray(topk_idx).reshape(-1)
    counts = np.bincount(ids[ids >= 0], minlength=num_experts)
    rows = int(sum(-(-int(c) // BLOCK) * BLOCK for c in counts))
    return max(1, -(-rows // ring_rows))


def _reference(inp, w):
    y = ref.moe_forward(
        inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"], w["w1"], w["w1_sf"], w["w2"], w["w2_sf"]
    )
    return y.astype(np.float32)


# hidden, intermediate, experts, topk, capacity, tokens, ring as a share of the worst-case pool
RING_CASES = [
    (512, 256, 16, 6, 4096, 4096, 0.25),
    (512, 256, 16, 6, 4096, 4096, 1 / 64),  # the smallest ring: many cycles
    (1024, 512, 32, 6, 1024, 1000, 0.3),
    (7168, 2048, 8, 6, 512, 512, 0.2),
    (4096, 2048, 32, 6, 2048, 2048, 0.25),  # flash-like per-rank slice
    (512, 256, 4, 2, 8192, 8192, 0.1),  # few experts: one expert spans several cycles
]


@pytest.mark.parametrize("h,i,e,k,cap,t,ratio", RING_CASES, ids=lambda v: str(v))
def test_an_unfused_ring_gives_the_bits_of_the_full_pool(h, i, e, k, cap, t, ratio):
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    full = _layer(h, i, e, k, cap, w, mode="unfused")
    ring = _layer(h, i, e, k, cap, w, mode="unfused", chunk_ratio=ratio)
    assert ring.runner.ring and ring.layout.pool_blocks < full.layout.pool_blocks
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.05)
    args = device_args(inp)
    want = run_poisoned(full, args)
    np.testing.assert_array_equal(run_poisoned(ring, args), want)
    assert _pool_cycles(ring) == _expected_cycles(inp["topk_idx"], e, ring.layout.pool_rows) > 1
    assert _pool_cycles(full) == 1
    if t <= 1024:
        assert ref.calc_diff(bf16(want), _reference(inp, w)) < 1e-3


def test_an_unfused_ring_with_skewed_routing_a_bound_int64_ids_and_an_empty_call():
    h, i, e, k, cap = 512, 256, 16, 4, 4096
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    full = _layer(h, i, e, k, cap, w, mode="unfused")
    ring = _layer(h, i, e, k, cap, w, mode="unfused", chunk_ratio=0.1)
    fused = _layer(h, i, e, k, cap, w, mode="fused", chunk_ratio=0.1)
    inp = ref.random_moe_inputs(rng, 3000, h, i, e, k)
    inp["topk_idx"][:2500] = np.array([3, 4, 5, 6])  # most rows on four experts, spanning cycles
    inp["topk_idx"] = inp["topk_idx"].astype(np.int64)
    args = device_args(inp)
    want = run_poisoned(full, args)
    np.testing.assert_array_equal(run_poisoned(ring, args), want)
    np.testing.assert_array_equal(run_poisoned(fused, args), want)
    assert _pool_cycles(ring) == _expected_cycles(inp["topk_idx"], e, ring.layout.pool_rows) > 1
    # A bound below the capacity enqueues fewer cycles; its calls still get every row.
    small = [a[:700] for a in args]
    assert ring.runner.cycles_to_launch(700) < ring.runner.cycles_to_launch(cap)
    np.testing.assert_array_equal(run_poisoned(ring, small, num_tokens_bound=700), run_poisoned(full, small))
    assert _pool_cycles(ring) == _expected_cycles(inp["topk_idx"][:700], e, ring.layout.pool_rows)
    empty = [a[:0] for a in args]
    assert run_poisoned(ring, empty).shape == (0, h)


def test_an_unfused_ring_replays_in_a_graph_with_new_inputs():
    h, i, e, k, cap = 512, 256, 16, 6, 2048
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    full = _layer(h, i, e, k, cap, w, mode="unfused")
    ring = _layer(h, i, e, k, cap, w, mode="unfused", chunk_ratio=0.2)
    args = device_args(ref.random_moe_inputs(rng, cap, h, i, e, k))
    out = cp.full((cap, h), BF16_NAN, dtype=cp.uint16)
    replay_with_new_inputs(
        ring,
        args,
        out,
        lambda: device_args(ref.random_moe_inputs(rng, cap, h, i, e, k)),
        lambda now: run_poisoned(full, now),
    )


# A flash-like EP8 slice: hidden 4096, intermediate 2048, 32 local experts of top-6.
FLASH_SLICE = (4096, 2048, 32, 6)


def _long_inputs(rng, t, h, e, k):
    """Device inputs for t tokens, made on the device (the host would take minutes)."""
    from megamoe_rt import quantize_fp8

    x = cp.asarray(rng.standard_normal((t, h), dtype=np.float32))
    q, sf = quantize_fp8(x)
    idx = cp.argsort(cp.random.random((t, e)), axis=1)[:, :k].astype(cp.int32)
    idx[cp.random.random((t, k)) < 0.02] = -1
    logits = cp.random.standard_normal((t, k), dtype=cp.float32)
    weights = cp.exp(logits) / cp.exp(logits).sum(axis=1, keepdims=True)
    return [q, sf, idx, weights.astype(cp.float32)]


@pytest.mark.parametrize("t", [16384, 32768, 65536])
def test_long_prefill_every_mode_and_ring_agrees_and_matches_the_reference_on_a_sample(t):
    h, i, e, k = FLASH_SLICE
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    args = _long_inputs(rng, t, h, e, k)
    layers = {
        "unfused": dict(mode="unfused"),
        "unfused ring 1/4": dict(mode="unfused", chunk_ratio=0.25),
        "fused": dict(mode="fused"),
        "fused ring 1/8": dict(mode="fused", chunk_ratio=0.125),
        "split ring 1/4": dict(mode="split", chunk_ratio=0.25),
    }
    outs = {}
    for name, kw in layers.items():
        layer = _layer(h, i, e, k, t, w, **kw)
        outs[name] = run_poisoned(layer, args)
        if name == "unfused ring 1/4":
            assert _pool_cycles(layer) == _expected_cycles(cp.asnumpy(args[2]), e, layer.layout.pool_rows) >= 4
        layer.close()
    want = outs.pop("unfused")
    for name, got in outs.items():
        np.testing.assert_array_equal(got, want, err_msg=name)
    sample = np.sort(rng.choice(t, size=24, replace=False))
    sub = {
        "x": cp.asnumpy(args[0][sample]).view(ref.E4M3),
        "x_sf": cp.asnumpy(args[1][sample]),
        "topk_idx": cp.asnumpy(args[2][sample]),
        "topk_weights": cp.asnumpy(args[3][sample]),
    }
    exp = _reference(sub, w)
    assert np.isfinite(bf16(want)).all()
    assert ref.calc_diff(bf16(want[sample]), exp) < 1e-3
