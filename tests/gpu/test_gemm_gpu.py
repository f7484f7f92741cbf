"""Grouped FP8 GEMM on the GPU against the reference numerics (needs a Hopper GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref
from megamoe_rt.kernels.grouped_gemm import (
    GROUP_ALIGN,
    grouped_gemm_fp8,
    grouped_gemm_swiglu_fp8,
    prepare_swiglu_weights,
)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BF16_NAN = 0x7FC1
E4M3_NAN = 0x7F


def _quantized_rows(rng, rows, k, gran=128):
    """Random e4m3 rows with positive per-row scales of varied magnitude."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if gran == 128:
        q, sf = ref.quantize_act_1x128(x)
    else:
        q = x.astype(ref.E4M3)
        sf = np.exp2(rng.uniform(-6, 2, size=(rows, k // 64))).astype(np.float32)
    sf *= np.exp2(rng.integers(-3, 4, size=(rows, 1))).astype(np.float32)
    return q, sf


def _weights(rng, groups, n, k):
    w = (rng.standard_normal((groups, n, k)) / np.sqrt(k)).astype(np.float32)
    return ref.quantize_weight_128x128(w)


def _contiguous_problem(rng, counts, n, k, a_gran=128):
    counts = list(counts)
    padded = [-(-c // GROUP_ALIGN) * GROUP_ALIGN for c in counts]
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    rows = int(offsets[-1]) + GROUP_ALIGN  # slack past the last group: never read as a group
    a, a_sf = _quantized_rows(rng, rows, k, a_gran)
    b, b_sf = _weights(rng, len(counts), n, k)
    return a, a_sf, b, b_sf, offsets, np.array(counts, np.int32)


def _contiguous_bf16_call(a, a_sf, b, b_sf, offsets, counts, **destination):
    """The contiguous bf16 GEMM on device copies of the operands, into ``out=`` or ``row_dst=``."""
    grouped_gemm_fp8(
        _dev(a),
        _dev(a_sf),
        _dev(b),
        _dev(b_sf),
        group_offsets=cp.asarray(offsets),
        group_counts=cp.asarray(counts),
        **destination,
    )


def _run_contiguous_bf16(a, a_sf, b, b_sf, offsets, counts, n):
    """The contiguous bf16 GEMM into a poisoned output; returns the output on the host."""
    out = cp.full((a.shape[0], n), BF16_NAN, dtype=cp.uint16)
    _contiguous_bf16_call(a, a_sf, b, b_sf, offsets, counts, out=out)
    return cp.asnumpy(out)


def _bf16_bits_to_f32(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def _expected_rows(a, a_sf, b, b_sf, a_gran=128):
    """Dequantized float64 product: an independent formulation of the GEMM contract."""
    deq_a = ref.dequantize_act(a, a_sf, gran=a_gran).astype(np.float64)
    deq_b = ref.dequantize_weight(b, b_sf).astype(np.float64)
    return deq_a @ deq_b.T


def _dev(x):
    if x.dtype == ref.E4M3:
        return cp.asarray(x.view(np.uint8))
    return cp.asarray(x)


@pytest.mark.parametrize(
    "counts,n,k",
    [
        ([1000], 256, 7168),
        ([0, 1, 63, 65], 512, 256),
        ([64, 4096, 1], 7168, 512),
        ([37, 0, 128, 129, 5, 300, 64, 1], 384, 1024),
        (list(np.random.default_rng(7).integers(0, 100, size=64)), 256, 256),
        ([1536] * 4, 4096, 4096),
    ],
)
def test_contiguous_bf16_matches_reference(counts, n, k):
    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, counts, n, k)
    got = _run_contiguous_bf16(a, a_sf, b, b_sf, offsets, cnt, n)
    for g, c in enumerate(counts):
        start = offsets[g]
        exp = _expected_rows(a[start : start + c], a_sf[start : start + c], b[g], b_sf[g])
        res = _bf16_bits_to_f32(got[start : start + c])
        if c:
            assert np.isfinite(res).all(), f"group {g}: rows left unwritten"
            assert ref.calc_diff(res, exp) < 1e-5, f"group {g} ({c} rows)"
        # Padding rows of the group are not written.
        assert (got[start + c : offsets[g + 1]] == BF16_NAN).all()
    assert (got[offsets[-1] :] == BF16_NAN).all()


def test_group_offsets_without_counts_write_every_row():
    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, _ = _contiguous_problem(rng, [128, 256], 256, 512)
    out = cp.full((a.shape[0], 256), BF16_NAN, dtype=cp.uint16)
    grouped_gemm_fp8(_dev(a), _dev(a_sf), _dev(b), _dev(b_sf), group_offsets=cp.asarray(offsets), out=out)
    got = _bf16_bits_to_f32(cp.asnumpy(out))
    for g in range(2):
        s, e = offsets[g], offsets[g + 1]
        assert ref.calc_diff(got[s:e], _expected_rows(a[s:e], a_sf[s:e], b[g], b_sf[g])) < 1e-5


@pytest.mark.parametrize(
    "groups,m_max,counts",
    [
        (4, 64, [0, 1, 63, 64]),
        (3, 192, [192, 65, 0]),
        (32, 64, None),
    ],
)
def test_masked_bf16_matches_reference(groups, m_max, counts):
    rng = np.random.default_rng()
    if counts is None:
        counts = list(rng.integers(0, m_max + 1, size=groups))
    _check_masked_bf16(rng, groups, m_max, counts, 512, 1024)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_a_call_with_no_rows_ends_and_writes_nothing(layout):
    """Every block's producer finds no tile and announces the end at once (gemm/tile_slots.cuh):
    the launch must finish, write nothing, and leave the next call on the same buffers right."""
    rng = np.random.default_rng()
    if layout == "masked":
        _check_masked_bf16(rng, 4, 128, [0, 0, 0, 0], 256, 512)
        _check_masked_bf16(rng, 4, 128, [128, 0, 3, 128], 256, 512)
        return
    counts, n, k = [0, 0, 0], 256, 512
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, counts, n, k)
    assert (_run_contiguous_bf16(a, a_sf, b, b_sf, offsets, cnt, n) == BF16_NAN).all()


def _check_masked_bf16(rng, groups, m_max, counts, n, k, config=None, blocks=None):
    """A masked bf16 GEMM (``config``: a forced tile; ``blocks``: on that many persistent
    blocks, _on_few_blocks) against the reference; rows past a group's count stay poisoned."""
    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8

    a, a_sf = _quantized_rows(rng, groups * m_max, k)
    b, b_sf = _weights(rng, groups, n, k)
    out = cp.full((groups, m_max, n), BF16_NAN, dtype=cp.uint16)
    plan = plan_grouped_gemm_fp8(
        _dev(a).reshape(groups, m_max, k),
        _dev(a_sf).reshape(groups, m_max, k // 128),
        _dev(b),
        _dev(b_sf),
        masked_counts=cp.asarray(np.array(counts, np.int32)),
        out=out,
        config=config,
    )
    _on_few_blocks(plan, blocks)
    got = cp.asnumpy(out)
    for g, c in enumerate(counts):
        rows = slice(g * m_max, g * m_max + c)
        if c:
            exp = _expected_rows(a[rows], a_sf[rows], b[g], b_sf[g])
            assert ref.calc_diff(_bf16_bits_to_f32(got[g, :c]), exp) < 1e-5, f"group {g}"
        assert (got[g, c:] == BF16_NAN).all()


def test_1x64_activation_scales():
    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, [300, 77], 256, 768, a_gran=64)
    got = _run_contiguous_bf16(a, a_sf, b, b_sf, offsets, cnt, 256)
    for g, c in enumerate([300, 77]):
        s = offsets[g]
        exp = _expected_rows(a[s : s + c], a_sf[s : s + c], b[g], b_sf[g], a_gran=64)
        assert ref.calc_diff(_bf16_bits_to_f32(got[s : s + c]), exp) < 1e-5


def test_scatter_epilogue_writes_rows_to_their_addresses():
    rng = np.random.default_rng()
    counts = [200, 57]
    n, k = 256, 512
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, counts, n, k)
    rows = a.shape[0]
    dest = cp.full((rows, n), BF16_NAN, dtype=cp.uint16)
    perm = rng.permutation(rows)
    keep = rng.random(rows) < 0.8
    row_dst = np.where(keep, dest.data.ptr + perm * n * 2, 0).astype(np.uint64)
    _contiguous_bf16_call(a, a_sf, b, b_sf, offsets, cnt, row_dst=cp.asarray(row_dst))
    got = cp.asnumpy(dest)
    written = np.zeros(rows, bool)
    for g, c in enumerate(counts):
        s = offsets[g]
        exp = _expected_rows(a[s : s + c], a_sf[s : s + c], b[g], b_sf[g])
        sel = keep[s : s + c]
        res = _bf16_bits_to_f32(got[perm[s : s + c][sel]])
        assert ref.calc_diff(res, exp[sel]) < 1e-5
        written[perm[s : s + c][sel]] = True
    assert (got[~written] == BF16_NAN).all()


def test_swiglu_out_must_be_16_byte_aligned():
    """Rows are stored 16 bytes at a time: an e4m3 `out` starting 8 bytes into an allocation is
    refused before the launch."""
    rng = np.random.default_rng()
    a, a_sf, w1, w1_sf, offsets, cnt = _contiguous_problem(rng, [130], 256, 256)
    w1p, w1p_sf = prepare_swiglu_weights(w1.view(np.uint8), w1_sf)
    rows = a.shape[0]
    shifted = cp.empty(rows * 128 + 16, cp.uint8)[8 : 8 + rows * 128].reshape(rows, 128)
    with pytest.raises(ValueError, match="out: data pointer .* is not 16-byte aligned"):
        grouped_gemm_swiglu_fp8(
            _dev(a),
            _dev(a_sf),
            cp.asarray(w1p),
            cp.asarray(w1p_sf),
            cp.asarray(rng.uniform(0.1, 1.0, size=rows).astype(np.float32)),
            group_offsets=cp.asarray(offsets),
            group_counts=cp.asarray(cnt),
            act_sf_gran=64,
            out=shifted,
            out_sf=cp.empty((2, -(-rows // 4) * 4), cp.float32),
        )


def _swiglu_reference(a, a_sf, w1, w1_sf, weight, limit, gran, pow2):
    l1 = ref.fp8_block_gemm(a, a_sf, w1, w1_sf)
    inter = w1.shape[0] // 2
    act = ref.swiglu(l1[:, :inter], l1[:, inter:], limit) * weight[:, None]
    return act, ref.requant_rows(act, gran, pow2)


@pytest.mark.parametrize("gran", [64, 128])
@pytest.mark.parametrize("limit,pow2", [(None, False), (0.4, False), (None, True)])
def test_swiglu_epilogue_within_requant(gran, limit, pow2):
    rng = np.random.default_rng()
    counts, inter, hidden = [300, 0, 129], 256, 512
    a, a_sf, w1, w1_sf, offsets, cnt = _contiguous_problem(rng, counts, 2 * inter, hidden)
    weight = rng.uniform(0.05, 1.0, size=a.shape[0]).astype(np.float32)
    w1p, w1p_sf = prepare_swiglu_weights(w1.view(np.uint8), w1_sf)
    rows = a.shape[0]
    q = cp.full((rows, inter), E4M3_NAN, dtype=cp.uint8)
    rows_pad = -(-rows // 4) * 4
    sf = cp.full((inter // gran, rows_pad), np.nan, dtype=cp.float32)
    grouped_gemm_swiglu_fp8(
        _dev(a),
        _dev(a_sf),
        cp.asarray(w1p),
        cp.asarray(w1p_sf),
        cp.asarray(weight),
        group_offsets=cp.asarray(offsets),
        group_counts=cp.asarray(cnt),
        act_sf_gran=gran,
        swiglu_limit=limit,
        pow2_scale=pow2,
        out=q,
        out_sf=sf,
    )
    gq, gsf = cp.asnumpy(q), cp.asnumpy(sf)
    for g, c in enumerate(counts):
        s = offsets[g]
        # A group's padding rows (past its count, in the tile of its last rows) are never written.
        assert (gq[s + c : offsets[g + 1]] == E4M3_NAN).all(), f"group {g}: padding rows written"
        if not c:
            continue
        act, (rq, rsf) = _swiglu_reference(
            a[s : s + c], a_sf[s : s + c], w1[g], w1_sf[g], weight[s : s + c], limit, gran, pow2
        )
        got_sf = gsf[:, s : s + c].T
        assert np.isfinite(got_sf).all()
        if pow2:
            assert (np.frexp(got_sf)[0] == 0.5).all()
            # A power-of-two scale may land one step away where amax sits on a boundary.
            ratio = got_sf / rsf
            assert np.isin(ratio, [0.5, 1.0, 2.0]).all() and (ratio == 1.0).mean() > 0.99
        else:
            # The accumulation error of a dot product scales with its terms, not with its result:
            # a row whose amax comes out of heavy cancellation needs an absolute allowance too.
            np.testing.assert_allclose(got_sf, rsf, rtol=2e-3, atol=2e-3 * float(np.median(rsf)))
        got = ref.dequantize_act(gq[s : s + c].view(ref.E4M3), got_sf, gran=gran)
        assert ref.calc_diff(got, act) < 1e-3
        # Codes agree with the reference's except where fp32 rounding differences cross a rounding boundary.
        same = (gq[s : s + c] == rq.view(np.uint8)).mean()
        assert same > 0.97, same
        assert (gq[s + c : offsets[g + 1]] == E4M3_NAN).all()


def test_two_runs_are_bitwise_identical():
    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, [700, 300, 1000], 1024, 2048)
    args = (_dev(a), _dev(a_sf), _dev(b), _dev(b_sf))
    o1 = grouped_gemm_fp8(*args, group_offsets=cp.asarray(offsets), group_counts=cp.asarray(cnt))
    o2 = grouped_gemm_fp8(*args, group_offsets=cp.asarray(offsets), group_counts=cp.asarray(cnt))
    for g, c in enumerate([700, 300, 1000]):  # padding rows are never written: compare real rows
        s = int(offsets[g])
        assert bool((o1[s : s + c] == o2[s : s + c]).all()), f"group {g} differs between runs"


def test_bad_arguments_raise_before_launch():
    a = cp.zeros((256, 256), cp.uint8)
    a_sf = cp.ones((256, 2), cp.float32)
    b = cp.zeros((2, 256, 256), cp.uint8)
    b_sf = cp.ones((2, 2, 2), cp.float32)
    offs = cp.asarray(np.array([0, 128, 256], np.int32))
    with pytest.raises(ValueError, match="exactly one of group_offsets"):
        grouped_gemm_fp8(a, a_sf, b, b_sf)
    with pytest.raises(TypeError, match="a: dtype float32"):
        grouped_gemm_fp8(a.astype(cp.float32), a_sf, b, b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match="b: K = 200"):
        grouped_gemm_fp8(a, a_sf, cp.zeros((2, 256, 200), cp.uint8), b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match="b_sf: expected shape"):
        grouped_gemm_fp8(a, a_sf, b, cp.ones((2, 2, 3), cp.float32), group_offsets=offs)
    with pytest.raises(ValueError, match="a_sf: expected shape"):
        grouped_gemm_fp8(a, cp.ones((256, 3), cp.float32), b, b_sf, group_offsets=offs)
    with pytest.raises(ValueError, match="group_offsets: expected shape"):
        grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=offs[:2])
    with pytest.raises(TypeError, match="group_offsets: dtype int64"):
        grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=offs.astype(cp.int64))
    with pytest.raises(ValueError, match="out: expected shape"):
        grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=offs, out=cp.empty((256, 128), cp.uint16))
    # Rows are stored 16 bytes at a time: an `out` starting 4 bytes into an allocation is refused.
    shifted = cp.empty(256 * 256 + 8, cp.uint16)[2 : 2 + 256 * 256].reshape(256, 256)
    with pytest.raises(ValueError, match="out: data pointer .* is not 16-byte aligned"):
        grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=offs, out=shifted)


@pytest.mark.parametrize(
    "field, bad, message",
    [
        ("group_offsets", [0, 100, 256], r"group_offsets\[1\] = 100"),
        ("group_offsets", [0, 256, 128], r"group_offsets\[2\] = 128"),
        ("group_offsets", [0, 128, 512], r"group_offsets\[2\] = 512"),
        ("group_counts", [5, -3], r"group_counts\[1\] = -3"),
    ],
)
def test_a_bad_group_layout_skips_the_gemm_and_raises(field, bad, message):
    """No trap: the GEMM writes nothing, the error names the entry, and the context lives on."""
    from megamoe_rt import DeviceInputError

    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, [100, 70], 256, 256)
    args = dict(group_offsets=cp.asarray(offsets), group_counts=cp.asarray(cnt))
    args[field] = cp.asarray(np.array(bad, np.int32))
    out = cp.full((a.shape[0], 256), BF16_NAN, dtype=cp.uint16)
    with pytest.raises(DeviceInputError, match=message):
        grouped_gemm_fp8(_dev(a), _dev(a_sf), _dev(b), _dev(b_sf), out=out, **args)
    assert (cp.asnumpy(out) == BF16_NAN).all(), "the GEMM ran on a refused layout"
    # The context is intact: the same GEMM with a good layout runs and is right.
    grouped_gemm_fp8(
        _dev(a),
        _dev(a_sf),
        _dev(b),
        _dev(b_sf),
        out=out,
        group_offsets=cp.asarray(offsets),
        group_counts=cp.asarray(cnt),
    )
    got = cp.asnumpy(out)
    for g, c in enumerate(cnt):
        s = offsets[g]
        exp = _expected_rows(a[s : s + c], a_sf[s : s + c], b[g], b_sf[g])
        assert ref.calc_diff(_bf16_bits_to_f32(got[s : s + c]), exp) < 1e-5


def test_a_plan_raises_a_bad_layout_at_its_next_run_without_waiting():
    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8

    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, [128, 40], 256, 256)
    offs = cp.asarray(offsets)
    out = cp.full((a.shape[0], 256), BF16_NAN, dtype=cp.uint16)
    plan = plan_grouped_gemm_fp8(_dev(a), _dev(a_sf), _dev(b), _dev(b_sf), group_offsets=offs, out=out)
    plan.run()
    plan.check(wait=True)  # a good layout: nothing to raise
    offs[1] = 100  # not a multiple of any tile height
    out.fill(BF16_NAN)
    plan.run()  # returns: the check runs on the device
    cp.cuda.Device().synchronize()
    with pytest.raises(ValueError, match=r"group_offsets\[1\] = 100"):
        plan.run()  # raises the earlier run's report and launches nothing
    assert (cp.asnumpy(out) == BF16_NAN).all()
    offs[1] = 128
    plan.run()
    plan.check(wait=True)
    assert np.isfinite(_bf16_bits_to_f32(cp.asnumpy(out)[:168])).all()


def test_masked_counts_out_of_range_are_refused():
    from megamoe_rt import DeviceInputError

    rng = np.random.default_rng()
    g, m, n, kk = 3, 128, 256, 256
    a, a_sf = _quantized_rows(rng, g * m, kk)
    b, b_sf = _weights(rng, g, n, kk)
    out = cp.full((g, m, n), BF16_NAN, dtype=cp.uint16)
    counts = cp.asarray(np.array([5, m + 1, 3], np.int32))
    with pytest.raises(DeviceInputError, match=r"masked_counts\[1\] = 129"):
        grouped_gemm_fp8(
            _dev(a).reshape(g, m, kk), _dev(a_sf).reshape(g, m, -1), _dev(b), _dev(b_sf), masked_counts=counts, out=out
        )
    assert (cp.asnumpy(out) == BF16_NAN).all()


def test_l2_consumes_swiglu_output_in_place():
    """L1 (fused epilogue) -> L2 with its k-major scales, both grans: the MoE data path."""
    rng = np.random.default_rng()
    counts, inter, hidden = [250, 6], 256, 384
    a, a_sf, w1, w1_sf, offsets, cnt = _contiguous_problem(rng, counts, 2 * inter, hidden)
    w2, w2_sf = _weights(rng, len(counts), hidden, inter)
    weight = rng.uniform(0.1, 1.0, size=a.shape[0]).astype(np.float32)
    w1p, w1p_sf = prepare_swiglu_weights(w1.view(np.uint8), w1_sf)
    for gran in (64, 128):
        q, sf = grouped_gemm_swiglu_fp8(
            _dev(a),
            _dev(a_sf),
            cp.asarray(w1p),
            cp.asarray(w1p_sf),
            cp.asarray(weight),
            group_offsets=cp.asarray(offsets),
            group_counts=cp.asarray(cnt),
            act_sf_gran=gran,
        )
        y = grouped_gemm_fp8(
            q,
            sf,
            _dev(w2),
            _dev(w2_sf),
            group_offsets=cp.asarray(offsets),
            group_counts=cp.asarray(cnt),
            a_sf_kmajor=True,
        )
        gq, gsf, gy = cp.asnumpy(q), cp.asnumpy(sf), cp.asnumpy(y)
        for g, c in enumerate(counts):
            s = offsets[g]
            exp = _expected_rows(gq[s : s + c].view(ref.E4M3), gsf[:, s : s + c].T.copy(), w2[g], w2_sf[g], a_gran=gran)
            assert ref.calc_diff(_bf16_bits_to_f32(gy[s : s + c]), exp) < 1e-5


def _on_few_blocks(plan, blocks):
    """Run a plan on ``blocks`` persistent CTAs (clusters) instead of one per SM (None: as
    planned), so each walks many tiles: every tile but a block's last is then stored under the
    next tile's first wgmmas, and the producer announces many tiles through the same slots."""
    if blocks is not None:
        plan.gemm.grid = min(plan.gemm.grid, blocks * plan.gemm.cluster[0])
    out = plan.run()
    plan.check(wait=True)
    return out


_HEURISTICS = __import__("megamoe_rt.kernels.gemm_heuristics", fromlist=["x"])
_ALL_TILE_CONFIGS = _HEURISTICS.candidate_configs() + _HEURISTICS.paired_tile_configs()
_BF16_MASKED = [c for c in _ALL_TILE_CONFIGS if c.layout == "masked" and c.epilogue == "bf16" and c.a_sf_gran == 128]


@pytest.mark.parametrize("blocks", [None, 1, 3])
@pytest.mark.parametrize("config", _BF16_MASKED, ids=lambda c: c.name)
def test_every_masked_bf16_tile_config(config, blocks):
    """Each compiled tile shape on partly filled masked groups (the tile's rows past a group's
    count are never written), on one block per SM and on few blocks."""
    _check_masked_bf16(np.random.default_rng(), 5, 256, [256, 0, 130, 1, 200], 512, 384, config=config, blocks=blocks)


_SWIGLU_CONTIGUOUS = [c for c in _ALL_TILE_CONFIGS if c.layout == "contiguous" and c.epilogue == "swiglu_fp8"]


@pytest.mark.parametrize("blocks", [None, 1, 3])
@pytest.mark.parametrize("config", _SWIGLU_CONTIGUOUS, ids=lambda c: c.name)
def test_every_swiglu_tile_config(config, blocks):
    """Each SwiGLU tile, on one block per SM and on few blocks that each walk many tiles (with
    128-wide requant groups the warpgroups' amax exchange then runs inside the deferred store)."""
    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_swiglu_fp8

    rng = np.random.default_rng()
    counts, inter, hidden = [300, 0, 129, 520], 512, 512
    gran = config.out_sf_gran
    a, a_sf, w1, w1_sf, offsets, cnt = _contiguous_problem(rng, counts, 2 * inter, hidden)
    weight = rng.uniform(0.05, 1.0, size=a.shape[0]).astype(np.float32)
    w1p, w1p_sf = prepare_swiglu_weights(w1.view(np.uint8), w1_sf)
    q = cp.full((a.shape[0], inter), E4M3_NAN, dtype=cp.uint8)
    plan = plan_grouped_gemm_swiglu_fp8(
        _dev(a),
        _dev(a_sf),
        cp.asarray(w1p),
        cp.asarray(w1p_sf),
        cp.asarray(weight),
        group_offsets=cp.asarray(offsets),
        group_counts=cp.asarray(cnt),
        act_sf_gran=gran,
        out=q,
        config=config,
    )
    _on_few_blocks(plan, blocks)
    gq, gsf = cp.asnumpy(q), cp.asnumpy(plan.result[1])
    for g, c in enumerate(counts):
        s = offsets[g]
        assert (gq[s + c : offsets[g + 1]] == E4M3_NAN).all(), f"group {g}: padding rows written"
        if not c:
            continue
        act, _ = _swiglu_reference(a[s : s + c], a_sf[s : s + c], w1[g], w1_sf[g], weight[s : s + c], None, gran, False)
        got = ref.dequantize_act(gq[s : s + c].view(ref.E4M3), gsf[:, s : s + c].T.copy(), gran=gran)
        assert ref.calc_diff(got, act) < 1e-3


def test_a_plan_keeps_every_array_it_points_to_alive():
    """Group offsets, counts and the output given only to the plan stay valid after the
    caller drops them (memory the pool hands out again is filled with garbage meanwhile)."""
    import gc

    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8

    rng = np.random.default_rng()
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, [70, 200], 256, 256)
    plan = plan_grouped_gemm_fp8(
        _dev(a), _dev(a_sf), _dev(b), _dev(b_sf), group_offsets=cp.asarray(offsets), group_counts=cp.asarray(cnt)
    )
    gc.collect()
    junk = [cp.full(n, -7, dtype=cp.int32) for n in (len(offsets), len(cnt), 64, 4096) for _ in range(8)]
    out = plan.run()
    plan.check(wait=True)
    got = cp.asnumpy(out)
    for g, c in enumerate(cnt):
        s = offsets[g]
        exp = _expected_rows(a[s : s + c], a_sf[s : s + c], b[g], b_sf[g])
        assert ref.calc_diff(_bf16_bits_to_f32(got[s : s + c]), exp) < 1e-5
    del junk


@pytest.mark.parametrize("blocks", [None, 1, 3])
@pytest.mark.parametrize(
    "config",
    [c for c in _ALL_TILE_CONFIGS if c.epilogue in ("bf16", "scatter_bf16") and c.layout == "contiguous"],
    ids=lambda c: c.name,
)
def test_every_contiguous_tile_config(config, blocks):
    """Each compiled tile shape / cluster / scale granularity, plain and scattered, on ragged
    groups: on one block per SM, and on few blocks that each walk many tiles."""
    from megamoe_rt.kernels.grouped_gemm import plan_grouped_gemm_fp8

    rng = np.random.default_rng()
    counts, n, k = [0, 300, 1, 129, 640], 512, 384
    a, a_sf, b, b_sf, offsets, cnt = _contiguous_problem(rng, counts, n, k, a_gran=config.a_sf_gran)
    rows = a.shape[0]
    dest = cp.full((rows, n), BF16_NAN, dtype=cp.uint16)
    common = dict(group_offsets=cp.asarray(offsets), group_counts=cp.asarray(cnt), config=config)
    if config.epilogue == "bf16":
        plan = plan_grouped_gemm_fp8(_dev(a), _dev(a_sf), _dev(b), _dev(b_sf), out=dest, **common)
        at = np.arange(rows)
    else:
        at = rng.permutation(rows)  # row r lands on row at[r] of dest
        row_dst = (dest.data.ptr + at * n * 2).astype(np.uint64)
        plan = plan_grouped_gemm_fp8(_dev(a), _dev(a_sf), _dev(b), _dev(b_sf), row_dst=cp.asarray(row_dst), **common)
    _on_few_blocks(plan, blocks)
    got = cp.asnumpy(dest)
    written = np.zeros(rows, bool)
    for g, c in enumerate(counts):
        s = offsets[g]
        if c:
            exp = _expected_rows(a[s : s + c], a_sf[s : s + c], b[g], b_sf[g], a_gran=config.a_sf_gran)
            assert ref.calc_diff(_bf16_bits_to_f32(got[at[s : s + c]]), exp) < 1e-5, f"group {g}"
        written[at[s : s + c]] = True
    assert (got[~written] == BF16_NAN).all(), "rows outside the groups' counts were written"
