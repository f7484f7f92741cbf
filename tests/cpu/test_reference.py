"""Tests for megamoe_rt.reference (CPU only).

Expectations are computed here independently, in plain float64 with a
hand-written E4M3 rounding, rather than by calling the functions under test.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt import reference as ref

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
HYP = settings(max_examples=20, deadline=None)


# ---------------------------------------------------------------------------
# Independent float64 formulations.
# ---------------------------------------------------------------------------


def f32_round(v):
    """Round float64 values to float32 and back (exact for results of one
    float32 op computed in float64: double rounding is innocuous for + - * /
    because 53 >= 2 * 24 + 2)."""
    return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)


def e4m3_rne(v):
    """Nearest E4M3 value (ties to even) of float64 ``v``, saturating at 448.

    The E4M3 grid has 3 fraction bits; below the minimum normal 2**-6 the
    spacing stays at 2**-9 (subnormals).
    """
    v = np.asarray(v, np.float64)
    _, exp = np.frexp(np.abs(v))  # |v| = m * 2**exp, m in [0.5, 1)
    spacing = np.exp2(np.maximum(exp - 1, -6) - 3.0)
    return np.clip(np.round(v / spacing) * spacing, -448.0, 448.0)  # np.round: half to even


def quant_groups64(groups, floor, pow2=False):
    """Independent recipe on groups along the last axis -> (codes f64, scale f64)."""
    g = np.asarray(groups, np.float64)
    amax = np.max(np.abs(g), axis=-1)
    scale = f32_round(np.maximum(amax, f32_round(floor)) / 448.0)
    if pow2:
        scale = np.exp2(np.ceil(np.log2(scale)))
    codes = e4m3_rne(f32_round(np.clip(g / scale[..., None], -448.0, 448.0)))
    return codes, scale


def quant_rows64(x, gran, floor, pow2=False):
    t, h = x.shape
    codes, scale = quant_groups64(np.asarray(x).reshape(t, h // gran, gran), floor, pow2)
    return codes.reshape(t, h), scale


def deq_rows64(q, sf, gran):
    return q.astype(np.float64) * np.repeat(sf.astype(np.float64), gran, axis=-1)


def deq_weight64(q, sf):
    full = np.repeat(np.repeat(sf.astype(np.float64), 128, axis=-2), 128, axis=-1)
    return q.astype(np.float64) * full


def silu_mul64(gate, up, limit):
    if limit is not None:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return gate * 0.5 * (1.0 + np.tanh(0.5 * gate)) * up  # stable sigmoid form


def moe_ref64(inp, *, limit=None, gran=128, pow2=False, requant=True):
    """Float64 MoE on dequantized operands.

    With ``requant`` the intermediate goes through the (independent) E4M3
    requantization so the comparison can be tight; without it the only
    difference to the contract is the FP8 intermediate.
    """
    x = deq_rows64(inp["x"], inp["x_sf"], 128)
    w1 = deq_weight64(inp["w1"], inp["w1_sf"])
    w2 = deq_weight64(inp["w2"], inp["w2_sf"])
    idx, wts = inp["topk_idx"], inp["topk_weights"].astype(np.float64)
    inter = w2.shape[2]
    y = np.zeros(x.shape)
    for e in range(w1.shape[0]):
        tok, slot = np.nonzero(idx == e)
        if tok.size == 0:
            continue
        l1 = x[tok] @ w1[e].T
        act = silu_mul64(l1[:, :inter], l1[:, inter:], limit) * wts[tok, slot][:, None]
        if requant:
            codes, scale = quant_rows64(f32_round(act), gran, 1e-10, pow2)
            act = codes * np.repeat(scale, gran, axis=1)
        np.add.at(y, tok, act @ w2[e].T)
    return y


def rel_err(got, want):
    want = np.asarray(want, np.float64)
    return np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30)


def inputs(seed, t=12, h=256, i=256, e=4, k=2, **kw):
    return ref.random_moe_inputs(np.random.default_rng(seed), t, h, i, e, k, **kw)


def random_act(rng, shape, log2_lo=-8, log2_hi=8):
    """Rows with magnitudes spread over many binades, incl. some all-zero groups."""
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(log2_lo, log2_hi, shape[:-1] + (1,)))
    return x.astype(np.float32)


# ---------------------------------------------------------------------------
# quantize_act_1x128 / dequantize_act
# ---------------------------------------------------------------------------


def check_act_quant(x, q, sf, gran=128, floor=1e-4):
    """Bit-exact recipe + error bounds for a 1 x gran quantization of x."""
    x64 = np.asarray(x).astype(np.float32).astype(np.float64)
    assert q.dtype == E4M3 and q.shape == x64.shape
    assert sf.dtype == np.float32 and sf.shape == (x64.shape[0], x64.shape[1] // gran)
    codes, scale = quant_rows64(x64, gran, floor)
    np.testing.assert_array_equal(sf.astype(np.float64), scale)
    np.testing.assert_array_equal(q.astype(np.float64), codes)
    # scale is max(amax, floor) / 448 up to one float32 rounding
    amax = np.abs(x64).reshape(sf.shape + (gran,)).max(axis=-1)
    np.testing.assert_allclose(sf, np.maximum(amax, floor) / 448.0, rtol=2.0**-23, atol=0)
    qf = q.astype(np.float64)
    assert np.all(np.isfinite(qf)) and np.all(np.abs(qf) <= 448.0)
    # E4M3 rounding error: half an ulp, relative 2**-4 for normals, absolute
    # 2**-10 (in scaled units) for subnormals.  Slack covers the f32 division.
    s_full = np.repeat(sf.astype(np.float64), gran, axis=1)
    err = np.abs(qf * s_full - x64)
    bound = np.maximum(np.abs(x64) * 2.0**-4, s_full * 2.0**-10) * (1 + 1e-6) + 1e-30
    assert np.all(err <= bound)
    # The group maximum always maps to the largest code when above the floor.
    big = amax >= floor
    peak = np.abs(qf).reshape(sf.shape + (gran,)).max(axis=-1)
    assert np.all(peak[big] == 448.0)


@HYP
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(0, 5), groups=st.integers(1, 3))
def test_quantize_act_matches_recipe(seed, t, groups):
    rng = np.random.default_rng(seed)
    x = random_act(rng, (t, groups * 128))
    if t:
        x[rng.integers(t), :128] = 0.0  # an all-zero group must still quantize
    q, sf = ref.quantize_act_1x128(x)
    check_act_quant(x, q, sf)


def test_quantize_act_zero_rows_and_tiny_values():
    x = np.zeros((3, 256), np.float32)
    x[1, :128] = 3e-6  # below the amax floor: scale is clamped, codes small
    q, sf = ref.quantize_act_1x128(x)
    floor_scale = np.float32(1e-4) / np.float32(448)
    assert np.all(sf[0] == floor_scale) and np.all(sf[2] == floor_scale)
    assert np.all(q[[0, 2]].astype(np.float32) == 0)
    check_act_quant(x, q, sf)


def test_quantize_act_dtypes_and_empty():
    rng = np.random.default_rng(1)
    x32 = random_act(rng, (4, 384))
    x_bf16 = x32.astype(BF16)
    q, sf = ref.quantize_act_1x128(x_bf16)
    check_act_quant(x_bf16, q, sf)
    # float64 input is first rounded to float32, so it matches the float32 path
    q64, sf64 = ref.quantize_act_1x128(x32.astype(np.float64))
    q32, sf32 = ref.quantize_act_1x128(x32)
    assert np.array_equal(q64.view(np.uint8), q32.view(np.uint8)) and np.array_equal(sf64, sf32)
    q0, sf0 = ref.quantize_act_1x128(np.zeros((0, 256), np.float32))
    assert q0.shape == (0, 256) and q0.dtype == E4M3 and sf0.shape == (0, 2)


def test_dequantize_act():
    rng = np.random.default_rng(2)
    x = random_act(rng, (3, 256))
    q, sf = ref.quantize_act_1x128(x)
    out = ref.dequantize_act(q, sf)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, deq_rows64(q, sf, 128), rtol=2.0**-23, atol=0)
    q64, sf64 = ref.requant_rows(x, gran=64)
    np.testing.assert_allclose(ref.dequantize_act(q64, sf64, 64), deq_rows64(q64, sf64, 64), rtol=2.0**-23)


# ---------------------------------------------------------------------------
# quantize_weight_128x128 / dequantize_weight
# ---------------------------------------------------------------------------


def weight_blocks(w):
    *lead, n, k = w.shape
    b = w.reshape(*lead, n // 128, 128, k // 128, 128)
    return np.moveaxis(b, -3, -2).reshape(*lead, n // 128, k // 128, 128 * 128)


@pytest.mark.parametrize("shape", [(128, 384), (2, 256, 128), (2, 1, 128, 256)])
def test_quantize_weight_matches_recipe(shape):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[..., :128, :128] = 0.0  # an all-zero block
    q, sf = ref.quantize_weight_128x128(w)
    assert q.dtype == E4M3 and q.shape == w.shape
    assert sf.dtype == np.float32 and sf.shape == shape[:-2] + (shape[-2] // 128, shape[-1] // 128)
    codes, scale = quant_groups64(weight_blocks(w.astype(np.float64)), 1e-4)
    np.testing.assert_array_equal(sf.astype(np.float64), scale)
    np.testing.assert_array_equal(weight_blocks(q.astype(np.float64)), codes)
    assert np.all(sf[..., 0, 0] == np.float32(1e-4) / np.float32(448))
    deq = ref.dequantize_weight(q, sf)
    np.testing.assert_allclose(deq, deq_weight64(q, sf), rtol=2.0**-23)
    s_full = np.repeat(np.repeat(sf.astype(np.float64), 128, -2), 128, -1)
    bound = np.maximum(np.abs(w) * 2.0**-4, s_full * 2.0**-10) * (1 + 1e-6) + 1e-30
    assert np.all(np.abs(deq_weight64(q, sf) - w) <= bound)


def test_quantize_weight_bf16_and_empty_batch():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((128, 256)) * 3).astype(BF16)
    q, sf = ref.quantize_weight_128x128(w)
    q2, sf2 = ref.quantize_weight_128x128(w.astype(np.float32))
    assert np.array_equal(q.view(np.uint8), q2.view(np.uint8)) and np.array_equal(sf, sf2)
    q0, sf0 = ref.quantize_weight_128x128(np.zeros((0, 128, 256), np.float32))
    assert q0.shape == (0, 128, 256) and sf0.shape == (0, 1, 2)


# ---------------------------------------------------------------------------
# fp8_block_gemm
# ---------------------------------------------------------------------------


def gemm_operands(rng, m, n, k, a_gran):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    qa, sa = ref.quantize_act_1x128(a) if a_gran == 128 else ref.requant_rows(a, gran=a_gran)
    qb, sb = ref.quantize_weight_128x128(b)
    return qa, sa, qb, sb


@pytest.mark.parametrize("a_gran", [64, 128])
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (7, 256, 384), (16, 128, 512)])
def test_gemm_matches_float64(a_gran, m, n, k):
    rng = np.random.default_rng(m * n + k + a_gran)
    qa, sa, qb, sb = gemm_operands(rng, m, n, k, a_gran)
    out = ref.fp8_block_gemm(qa, sa, qb, sb, a_gran=a_gran)
    assert out.dtype == np.float32 and out.shape == (m, n)
    want = deq_rows64(qa, sa, a_gran) @ deq_weight64(qb, sb).T
    assert ref.calc_diff(out, want) < 1e-6
    assert rel_err(out, want) < 1e-5


def test_gemm_single_block_is_exact_product_rounded_once():
    # One K block and unit scales: the result must be the exact dot product
    # rounded once to float32, whatever the summation order.
    rng = np.random.default_rng(4)
    qa = rng.uniform(-448, 448, (5, 128)).astype(np.float32).astype(E4M3)
    qb = rng.uniform(-448, 448, (128, 128)).astype(np.float32).astype(E4M3)
    ones_a, ones_b = np.ones((5, 1), np.float32), np.ones((1, 1), np.float32)
    out = ref.fp8_block_gemm(qa, ones_a, qb, ones_b)
    exact = qa.astype(np.float64) @ qb.astype(np.float64).T
    np.testing.assert_array_equal(out, exact.astype(np.float32))


def test_gemm_float32_accumulation_bit_exact():
    # The contract's float32 steps written as float64 ops each rounded to
    # float32 (innocuous double rounding), with general non power-of-two scales.
    rng = np.random.default_rng(7)
    for a_gran in (64, 128):
        qa, sa, qb, sb = gemm_operands(rng, 6, 256, 512, a_gran)
        a64, b64 = qa.astype(np.float64), qb.astype(np.float64)
        acc = np.zeros((6, 256))
        for kb in range(512 // a_gran):
            cols = slice(kb * a_gran, (kb + 1) * a_gran)
            partial = f32_round(a64[:, cols] @ b64[:, cols].T)
            b_scale = np.repeat(sb[:, kb * a_gran // 128].astype(np.float64), 128)
            term = f32_round(f32_round(partial * sa[:, kb, None]) * b_scale[None, :])
            acc = f32_round(acc + term)
        out = ref.fp8_block_gemm(qa, sa, qb, sb, a_gran=a_gran)
        np.testing.assert_array_equal(out.astype(np.float64), acc)


def test_gemm_empty_m():
    rng = np.random.default_rng(5)
    qa, sa, qb, sb = gemm_operands(rng, 0, 128, 256, 64)
    out = ref.fp8_block_gemm(qa, sa, qb, sb, a_gran=64)
    assert out.shape == (0, 128) and out.dtype == np.float32


# ---------------------------------------------------------------------------
# swiglu / requant_rows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [None, 3.0])
def test_swiglu(limit):
    rng = np.random.default_rng(6)
    gate = (rng.standard_normal((4, 256)) * 20).astype(np.float32)
    up = (rng.standard_normal((4, 256)) * 20).astype(np.float32)
    gate[0, :4] = [-1e4, -200.0, 1e4, 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overflow in exp must not warn
        out = ref.swiglu(gate, up, limit)
    assert out.dtype == np.float32
    want = silu_mul64(gate.astype(np.float64), up.astype(np.float64), limit)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    if limit is not None:
        assert np.max(np.abs(out)) < np.max(np.abs(ref.swiglu(gate, up)))


def check_requant(act, gran, pow2):
    q, sf = ref.requant_rows(act, gran=gran, pow2_scale=pow2)
    assert q.dtype == E4M3 and sf.dtype == np.float32
    assert sf.shape == (act.shape[0], act.shape[1] // gran)
    raw = np.maximum(np.abs(act.astype(np.float64)).reshape(sf.shape + (gran,)).max(-1), 1e-10) / 448
    if pow2:
        mant, _ = np.frexp(sf)
        assert np.all(mant == 0.5), "pow2 scales must be exact powers of two"
        assert np.all(sf >= f32_round(raw)) and np.all(sf < 2 * raw)
    else:
        np.testing.assert_allclose(sf, raw, rtol=2.0**-23, atol=0)
    codes, scale = quant_rows64(act, gran, 1e-10, pow2)
    np.testing.assert_array_equal(sf.astype(np.float64), scale)
    np.testing.assert_array_equal(q.astype(np.float64), codes)
    s_full = np.repeat(sf.astype(np.float64), gran, axis=1)
    err = np.abs(q.astype(np.float64) * s_full - act)
    assert np.all(err <= np.maximum(np.abs(act) * 2.0**-4, s_full * 2.0**-10) * (1 + 1e-6) + 1e-30)


@HYP
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 4),
    groups=st.integers(1, 4),
    gran=st.sampled_from([64, 128]),
    pow2=st.booleans(),
)
def test_requant_rows(seed, n, groups, gran, pow2):
    rng = np.random.default_rng(seed)
    act = random_act(rng, (n, groups * gran), -30, 10)
    if n:
        act[0, :gran] = 0.0
    check_requant(act, gran, pow2)


def test_requant_pow2_keeps_exact_powers_and_floor():
    act = np.zeros((2, 128), np.float32)
    act[0, 5] = 448.0 * 2.0**-3  # raw scale exactly 2**-3
    q, sf = ref.requant_rows(act, pow2_scale=True)
    assert sf[0, 0] == np.float32(2.0**-3) and q[0, 5].astype(np.float32) == 448.0
    assert sf[1, 0] == np.float32(2.0 ** np.ceil(np.log2(1e-10 / 448)))
    _, sf_raw = ref.requant_rows(act)
    assert sf_raw[1, 0] == np.float32(1e-10) / np.float32(448)


# ---------------------------------------------------------------------------
# moe_forward
# ---------------------------------------------------------------------------


def run_and_check(inp, *, tight=1e-5, loose=1e-3, **kw):
    """moe_forward vs both float64 formulations; returns the BF16 output."""
    limit, gran, pow2 = kw.get("swiglu_limit"), kw.get("act_sf_gran", 128), kw.get("pow2_scale", False)
    y, partials, valid = ref.moe_forward(**inp, return_partials=True, **kw)
    t, h = inp["x"].shape
    assert y.dtype == BF16 and y.shape == (t, h)
    assert partials.dtype == BF16 and partials.shape == (inp["topk_idx"].shape[1], t, h)
    np.testing.assert_array_equal(valid, inp["topk_idx"] >= 0)
    assert np.all(partials[~valid.T].astype(np.float32) == 0)
    # tokens without any valid slot are exact zeros
    assert np.all(y[~valid.any(axis=1)].astype(np.float32) == 0)
    if t and valid.any():
        assert ref.calc_diff(y, moe_ref64(inp, limit=limit, gran=gran, pow2=pow2)) < tight
        assert ref.calc_diff(y, moe_ref64(inp, limit=limit, requant=False)) < loose
    return y


@pytest.mark.parametrize("gran", [64, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_moe_matches_float64(gran, pow2):
    inp = inputs(10 + gran + pow2, t=16, e=4, k=3, empty_slot_prob=0.25)
    inp["topk_idx"][3] = -1  # a token with no valid slot
    run_and_check(inp, act_sf_gran=gran, pow2_scale=pow2)


def test_moe_swiglu_limit_changes_result():
    inp = inputs(11, t=8, e=3, k=2)
    y_free = run_and_check(inp)
    # Pick a limit well inside the observed L1 range so the clamp bites.
    x = deq_rows64(inp["x"], inp["x_sf"], 128)
    l1_max = max(np.abs(x @ deq_weight64(inp["w1"][e], inp["w1_sf"][e]).T).max() for e in range(3))
    limit = 0.25 * l1_max
    y_clamped = run_and_check(inp, swiglu_limit=limit)
    assert ref.calc_diff(y_free, y_clamped) > 1e-3


def test_moe_routing_edge_cases():
    # Experts 2..5 receive nothing: poison their weights with NaN codes to prove
    # they are skipped, and route every token to expert 1 or nothing (K=1).
    inp = inputs(12, t=10, e=6, k=1)
    inp["topk_idx"][:] = 1
    inp["topk_idx"][::3] = -1
    inp["w1"][2:] = np.float32(np.nan)
    inp["w2"][2:] = np.float32(np.nan)
    y = run_and_check(inp)
    assert np.all(np.isfinite(y.astype(np.float32)))
    # all tokens to one expert (expert 0), int64 ids, K=2 with one slot empty
    inp = inputs(13, t=9, e=3, k=2, idx_dtype=np.int64)
    inp["topk_idx"][:, 0] = 0
    inp["topk_idx"][:, 1] = -1
    assert inp["topk_idx"].dtype == np.int64
    run_and_check(inp)


def test_moe_all_slots_empty_and_no_tokens():
    inp = inputs(14, t=5, e=2, k=2)
    inp["topk_idx"][:] = -1
    y = ref.moe_forward(**inp)
    assert y.shape == (5, 256) and np.all(y.view(np.uint16) == 0)  # +0.0 exactly
    inp = inputs(15, t=0, e=2, k=2)
    y, partials, valid = ref.moe_forward(**inp, return_partials=True)
    assert y.shape == (0, 256) and partials.shape == (2, 0, 256) and valid.shape == (0, 2)


def test_moe_tiny_weights_use_requant_floor():
    # Intermediate activations far below the input floor (1e-4) must keep
    # full relative precision: requant uses the 1e-10 floor.
    inp = inputs(19, t=8, e=3, k=2)
    inp["topk_weights"] *= np.float32(1e-6)
    y = run_and_check(inp)
    assert 0 < np.max(np.abs(y.astype(np.float32))) < 1e-4


@HYP
@given(
    seed=st.integers(0, 2**32 - 1),
    t=st.integers(0, 6),
    e=st.integers(1, 4),
    k=st.integers(1, 3),
    h=st.sampled_from([128, 256]),
    i=st.sampled_from([128, 256]),
    gran=st.sampled_from([64, 128]),
    pow2=st.booleans(),
    limit=st.sampled_from([None, 0.5, 7.0]),
    empty=st.sampled_from([0.0, 0.5]),
)
def test_moe_property(seed, t, e, k, h, i, gran, pow2, limit, empty):
    k = min(k, e)
    inp = inputs(seed, t=t, h=h, i=i, e=e, k=k, empty_slot_prob=empty)
    # Small token counts make the metric noisier; a looser tight bound still
    # catches any real recipe mismatch (those are O(1e-2) or worse).
    run_and_check(inp, tight=2e-5, loose=3e-3, swiglu_limit=limit, act_sf_gran=gran, pow2_scale=pow2)


def test_moe_slot_order_sum_is_bit_exact():
    inp = inputs(16, t=16, e=5, k=4, empty_slot_prob=0.3)
    y, partials, valid = ref.moe_forward(**inp, return_partials=True)
    acc = np.zeros(y.shape, np.float32)
    for s in range(partials.shape[0]):  # float32 running sum in slot order
        for tok in np.nonzero(valid[:, s])[0]:
            acc[tok] = acc[tok] + partials[s, tok].astype(np.float32)
    assert np.array_equal(y.view(np.uint16), acc.astype(BF16).view(np.uint16))
    # each valid partial matches its own float64 single-slot computation
    for s in range(partials.shape[0]):
        single = dict(inp, topk_idx=np.where(np.arange(4) == s, inp["topk_idx"], -1).astype(np.int32))
        want = moe_ref64(single)
        got = partials[s].astype(np.float64)
        rows = valid[:, s]
        assert ref.calc_diff(got[rows], want[rows]) < 1e-5


def test_moe_slot_order_matters():
    # Slots 0 and 1 hit two experts with the same weights, scaled by +1 and
    # -1, so their partials cancel exactly; slot 2 is a tiny contribution.
    # Summing in slot order gives (p0 + -p0) + p2 == p2 exactly, any other
    # order loses p2's low bits against the large p0.  (One expert named twice
    # would be a repeated id, which counts once.)
    inp = inputs(20, t=8, e=3, k=3)
    for name in ("w1", "w1_sf", "w2", "w2_sf"):
        inp[name][1] = inp[name][0]
    inp["topk_idx"][:] = np.array([0, 1, 2], np.int32)
    inp["topk_weights"][:] = np.array([1.0, -1.0, 1e-6], np.float32)
    y, partials, _ = ref.moe_forward(**inp, return_partials=True)
    negated = (-partials[0].astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(partials[1].view(np.uint16), negated.view(np.uint16))
    assert np.array_equal(y.view(np.uint16), partials[2].view(np.uint16))
    p = [partials[s].astype(np.float32) for s in range(3)]
    assert not np.array_equal(((p[2] + p[1]) + p[0]).astype(BF16).view(np.uint16), y.view(np.uint16))


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _bad_moe_cases():
    return [
        ("x", lambda d: d.update(x=d["x"].astype(np.float32))),
        ("x", lambda d: d.update(x=d["x"][:, :200])),
        ("x_sf", lambda d: d.update(x_sf=d["x_sf"].astype(np.float64))),
        ("x_sf", lambda d: d.update(x_sf=d["x_sf"][:, :1])),
        ("topk_idx", lambda d: d.update(topk_idx=d["topk_idx"].astype(np.float32))),
        ("topk_idx", lambda d: d["topk_idx"].__setitem__((0, 0), 4)),
        ("topk_idx", lambda d: d["topk_idx"].__setitem__((1, 1), -2)),
        ("topk_weights", lambda d: d.update(topk_weights=d["topk_weights"][:, :1])),
        ("topk_weights", lambda d: d.update(topk_weights=d["topk_weights"].astype(BF16))),
        ("w1", lambda d: d.update(w1=d["w1"].astype(BF16))),
        ("w1", lambda d: d.update(w1=d["w1"][:, :192])),
        ("w1_sf", lambda d: d.update(w1_sf=d["w1_sf"][:, :1])),
        ("w2", lambda d: d.update(w2=d["w2"][:3])),
        ("w2_sf", lambda d: d.update(w2_sf=d["w2_sf"].astype(np.float64))),
        ("act_sf_gran", lambda d: d.update(act_sf_gran=32)),
        ("act_sf_gran", lambda d: d.update(act_sf_gran="128")),
        ("swiglu_limit", lambda d: d.update(swiglu_limit=-1.0)),
    ]


@pytest.mark.parametrize("name,mutate", _bad_moe_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_moe_validation(name, mutate):
    inp = inputs(17, t=4, e=4, k=2)
    mutate(inp)
    with pytest.raises((ValueError, TypeError), match=f"^{name}:"):
        ref.moe_forward(**inp)


def test_other_validation():
    q, sf = ref.quantize_act_1x128(np.ones((2, 256), np.float32))
    qw, sw = ref.quantize_weight_128x128(np.ones((128, 256), np.float32))
    cases = [
        ("x", lambda: ref.quantize_act_1x128(np.ones((2, 100), np.float32))),
        ("x", lambda: ref.quantize_act_1x128(np.ones((2, 128), np.int32))),
        ("x", lambda: ref.quantize_act_1x128(np.full((1, 128), np.inf, np.float32))),
        ("w", lambda: ref.quantize_weight_128x128(np.ones((100, 128), np.float32))),
        ("a_gran", lambda: ref.fp8_block_gemm(q, sf, qw, sw, a_gran=96)),
        ("a_sf", lambda: ref.fp8_block_gemm(q, sf[:, :1], qw, sw)),
        ("b", lambda: ref.fp8_block_gemm(q, sf, qw.astype(np.float32), sw)),
        ("b_sf", lambda: ref.fp8_block_gemm(q, sf, qw, sw.T.copy())),
        ("gran", lambda: ref.requant_rows(np.ones((2, 256), np.float32), gran=256)),
        ("act", lambda: ref.requant_rows(np.ones((2, 96), np.float32), gran=64)),
        ("sf", lambda: ref.dequantize_act(q, sf.astype(np.float64))),
        ("q", lambda: ref.dequantize_weight(qw[:, :100], sw)),
        ("up", lambda: ref.swiglu(np.ones(3, np.float32), np.ones(4, np.float32))),
        ("b", lambda: ref.calc_diff(np.ones(3), np.ones(4))),
    ]
    for name, call in cases:
        with pytest.raises((ValueError, TypeError), match=f"^{name}:"):
            call()


# ---------------------------------------------------------------------------
# calc_diff / random_moe_inputs
# ---------------------------------------------------------------------------


def test_calc_diff():
    rng = np.random.default_rng(18)
    a = rng.standard_normal((8, 32))
    b = a + 0.01 * rng.standard_normal(a.shape)
    assert ref.calc_diff(a, a) == pytest.approx(0.0, abs=1e-15)
    assert ref.calc_diff(a, -a) == pytest.approx(2.0)
    assert ref.calc_diff(a, b) == ref.calc_diff(b, a)
    assert ref.calc_diff(np.zeros(5), np.zeros(5)) == 0.0
    # independent value: |a-b|^2 / (|a|^2 + |b|^2)
    want = np.sum((a - b) ** 2) / np.sum(a * a + b * b)
    assert ref.calc_diff(a, b) == pytest.approx(want, rel=1e-6)
    # sensitive to scale, not just direction
    assert ref.calc_diff(a, 2 * a) == pytest.approx(1 - 4 / 5)
    assert isinstance(ref.calc_diff(a.astype(BF16), a.astype(np.float32)), float)


def test_random_moe_inputs():
    d = ref.random_moe_inputs(np.random.default_rng(19), 32, 256, 128, 6, 3, empty_slot_prob=0.3)
    idx, w = d["topk_idx"], d["topk_weights"]
    assert idx.dtype == np.int32 and idx.shape == (32, 3) and w.dtype == np.float32
    assert np.all((idx >= -1) & (idx < 6)) and np.any(idx == -1) and np.any(idx >= 0)
    for row in idx:
        ids = row[row >= 0]
        assert len(set(ids.tolist())) == len(ids)  # distinct experts per token
    assert np.all(w > 0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    assert d["w1"].shape == (6, 256, 256) and d["w2"].shape == (6, 256, 128)
    assert d["x"].dtype == E4M3 and np.count_nonzero(d["x"].astype(np.float32)) > 0.9 * d["x"].size
    # fresh draws: another generator gives different data
    d2 = ref.random_moe_inputs(np.random.default_rng(20), 32, 256, 128, 6, 3)
    assert not np.array_equal(d["w1"].view(np.uint8), d2["w1"].view(np.uint8))
