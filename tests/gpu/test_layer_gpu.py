"""MegaMoE (unfused and fused modes, one GPU) against the reference forward (needs a Hopper GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BF16_NAN = 0x7FC1


@pytest.fixture(params=["unfused", "fused"])
def mode(request):
    return request.param


def _layer(h, i, e, k, cap, **kw):
    from megamoe_rt import MegaMoE

    return MegaMoE(h, i, e, k, cap, **kw)


def _to_dev(inp):
    return (
        cp.asarray(inp["x"].view(np.uint8)),
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
    )


def _load(layer, inp):
    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])


def _bf16(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def _reference(inp, limit=None, gran=128, pow2=False):
    y = ref.moe_forward(
        inp["x"],
        inp["x_sf"],
        inp["topk_idx"],
        inp["topk_weights"],
        inp["w1"],
        inp["w1_sf"],
        inp["w2"],
        inp["w2_sf"],
        swiglu_limit=limit,
        act_sf_gran=gran,
        pow2_scale=pow2,
    )
    return y.astype(np.float32)


def _run(layer, inp, **kw):
    x, x_sf, idx, w = _to_dev(inp)
    out = cp.full((x.shape[0], layer.hidden), BF16_NAN, dtype=cp.uint16)
    y = layer(x, x_sf, idx, w, out=out, **kw)
    assert y is out
    return cp.asnumpy(y)


SHAPES = [
    # hidden, intermediate, experts, topk, tokens
    (512, 256, 8, 2, 128),
    (1024, 512, 32, 6, 1000),
    (4096, 2048, 8, 8, 7),
    (7168, 3072, 1, 1, 1),
    (7168, 2048, 8, 6, 64),
    (512, 256, 48, 8, 4096),
    (1024, 256, 48, 6, 0),
]


@pytest.mark.parametrize("h,i,e,k,t", SHAPES, ids=lambda v: str(v))
def test_matches_reference(h, i, e, k, t, mode):
    rng = np.random.default_rng()
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.1)
    layer = _layer(h, i, e, k, max(t, 1), mode=mode)
    _load(layer, inp)
    got = _run(layer, inp)
    exp = _reference(inp)
    if t:
        assert np.isfinite(_bf16(got)).all()
        assert ref.calc_diff(_bf16(got), exp) < 1e-3


@pytest.mark.parametrize("limit,gran,pow2", [(None, 64, False), (0.5, 128, False), (0.5, 64, True), (None, 128, True)])
def test_clamp_and_requant_variants(limit, gran, pow2, mode):
    rng = np.random.default_rng()
    h, i, e, k, t = 1024, 512, 16, 4, 300
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, x_scale=4.0)
    layer = _layer(h, i, e, k, t, swiglu_limit=limit, act_sf_gran=gran, pow2_scale=pow2, mode=mode)
    _load(layer, inp)
    got = _bf16(_run(layer, inp))
    exp = _reference(inp, limit, gran, pow2)
    assert ref.calc_diff(got, exp) < 1e-3
    if limit is not None:  # the clamp changes this input's answer: the check has teeth
        assert ref.calc_diff(exp, _reference(inp, None, gran, pow2)) > 1e-3


def test_empty_slots_and_tokens_without_experts(mode):
    rng = np.random.default_rng()
    h, i, e, k, t = 512, 256, 8, 4, 200
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.4)
    inp["topk_idx"][:10] = -1  # tokens with no valid slot
    layer = _layer(h, i, e, k, 256, mode=mode)
    _load(layer, inp)
    got = _run(layer, inp)
    assert (got[:10] == 0).all()
    assert ref.calc_diff(_bf16(got), _reference(inp)) < 1e-3


def test_all_tokens_to_one_expert_and_int64_ids(mode):
    rng = np.random.default_rng()
    h, i, e, k, t = 1024, 512, 8, 1, 1000
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, idx_dtype=np.int64)
    inp["topk_idx"][:] = 5
    layer = _layer(h, i, e, k, 1024, track_expert_stats=True, mode=mode)
    _load(layer, inp)
    got = _run(layer, inp)
    assert ref.calc_diff(_bf16(got), _reference(inp)) < 1e-3
    assert cp.asnumpy(layer.expert_recv_stats).tolist() == [0, 0, 0, 0, 0, t, 0, 0]


def test_two_runs_are_bitwise_identical(mode):
    rng = np.random.default_rng()
    inp = ref.random_moe_inputs(rng, 777, 1024, 512, 16, 6, empty_slot_prob=0.2)
    layer = _layer(1024, 512, 16, 6, 1024, mode=mode)
    _load(layer, inp)
    assert np.array_equal(_run(layer, inp), _run(layer, inp))


def test_graph_capture_replays_with_new_inputs_and_counts_stats(mode):
    rng = np.random.default_rng()
    h, i, e, k, t = 1024, 512, 16, 4, 256
    layer = _layer(h, i, e, k, t, track_expert_stats=True, mode=mode)
    first = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.1)
    _load(layer, first)
    x, x_sf, idx, w = _to_dev(first)
    y = cp.empty((t, h), dtype=cp.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        layer(x, x_sf, idx, w, out=y, stream=stream)  # warm-up: kernels and plans load outside capture
        stream.synchronize()
        stats_before = cp.asnumpy(layer.expert_recv_stats).copy()
        stream.begin_capture()
        layer(x, x_sf, idx, w, out=y, stream=stream)
        graph = stream.end_capture()
    expected_stats = stats_before.astype(np.int64)
    for _ in range(3):
        new = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.1)
        new.update({n: first[n] for n in ("w1", "w1_sf", "w2", "w2_sf")})
        for dst, src in zip((x, x_sf, idx, w), _to_dev(new)):
            dst[...] = src
        y.fill(BF16_NAN)
        graph.launch(stream=stream)
        stream.synchronize()
        assert ref.calc_diff(_bf16(cp.asnumpy(y)), _reference(new)) < 1e-3
        ids = new["topk_idx"][new["topk_idx"] >= 0]
        expected_stats += np.bincount(ids, minlength=e)
        assert cp.asnumpy(layer.expert_recv_stats).tolist() == expected_stats.tolist()


def test_bad_inputs_raise_before_launch(mode):
    rng = np.random.default_rng()
    h, i, e, k, t = 512, 256, 8, 2, 64
    inp = ref.random_moe_inputs(rng, t, h, i, e, k)
    layer = _layer(h, i, e, k, t, mode=mode)
    x, x_sf, idx, w = _to_dev(inp)
    with pytest.raises(RuntimeError, match="load_weights"):
        layer(x, x_sf, idx, w)
    _load(layer, inp)
    with pytest.raises(TypeError, match="x: dtype float32"):
        layer(x.astype(cp.float32), x_sf, idx, w)
    with pytest.raises(ValueError, match="x: 128 tokens exceed"):
        layer(
            cp.zeros((128, h), cp.uint8),
            cp.ones((128, h // 128), cp.float32),
            cp.zeros((128, k), cp.int32),
            cp.ones((128, k), cp.float32),
        )
    with pytest.raises(ValueError, match="topk_idx: expected shape"):
        layer(x, x_sf, idx[:, :1].copy(), w)
    with pytest.raises(TypeError, match="topk_idx: dtype float32"):
        layer(x, x_sf, idx.astype(cp.float32), w)
    with pytest.raises(ValueError, match="x_sf: expected shape"):
        layer(x, x_sf[:, :1].copy(), idx, w)
    with pytest.raises(ValueError, match="w1: expected shape"):
        layer.load_weights(inp["w1"][:, :128], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    with pytest.raises(ValueError, match="num_topk"):
        _layer(h, i, 4, 8, t)


def test_reloaded_weights_reach_captured_graphs_and_later_calls(mode):
    """A second load_weights copies into the layer's arrays on the given stream: a graph captured
    before it replays with the new weights, and the caller's arrays are never the layer's."""
    rng = np.random.default_rng()
    h, i, e, k, t = 512, 256, 8, 4, 96
    first = ref.random_moe_inputs(rng, t, h, i, e, k)
    second = ref.random_moe_inputs(rng, t, h, i, e, k)
    second.update({n: first[n] for n in ("x", "x_sf", "topk_idx", "topk_weights")})
    layer = _layer(h, i, e, k, t, mode=mode)
    w2_dev = cp.asarray(first["w2"].view(np.uint8))
    layer.load_weights(first["w1"], first["w1_sf"], w2_dev, cp.asarray(first["w2_sf"]))
    w2_dev.fill(0)  # the caller reuses its array: the layer must have its own copy
    x, x_sf, idx, w = _to_dev(first)
    y = cp.full((t, h), BF16_NAN, dtype=cp.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        layer(x, x_sf, idx, w, out=y, stream=stream)
        stream.synchronize()
        assert ref.calc_diff(_bf16(cp.asnumpy(y)), _reference(first)) < 1e-3
        stream.begin_capture()
        layer(x, x_sf, idx, w, out=y, stream=stream)
        graph = stream.end_capture()
        layer.load_weights(second["w1"], second["w1_sf"], second["w2"], second["w2_sf"], stream=stream)
        y.fill(BF16_NAN)
        graph.launch(stream=stream)
        stream.synchronize()
    assert ref.calc_diff(_bf16(cp.asnumpy(y)), _reference(second)) < 1e-3
    y.fill(BF16_NAN)
    layer(x, x_sf, idx, w, out=y, stream=stream)
    stream.synchronize()
    assert ref.calc_diff(_bf16(cp.asnumpy(y)), _reference(second)) < 1e-3
    layer.synchronize()
