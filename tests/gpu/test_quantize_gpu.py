"""GPU FP8 quantizer against reference.py, bit for bit (needs a Hopper GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import megamoe_rt
from megamoe_rt import reference

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")


def _random_activations(rng, rows, hidden):
    """Fresh random data spanning many magnitudes, plus the edge cases that matter."""
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 9, size=(rows, 1))).astype(np.float32)
    if rows >= 4 and hidden >= 256:
        x[0, :128] = 0.0  # all-zero group: floor scale
        x[1, 128:256] = rng.standard_normal(128) * 1e-7  # amax below the 1e-4 floor
        x[2, 5] = 3.0e4  # one outlier dominates its group
        x[3, :128] = -x[3, :128]  # sign coverage
    return x


def _poisoned_outputs(rows, hidden):
    q = cp.full((rows, hidden), 0x7F, dtype=cp.uint8)  # e4m3 NaN
    sf = cp.full((rows, hidden // 128), np.nan, dtype=cp.float32)
    return q, sf


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("rows,hidden", [(1, 128), (7, 512), (128, 4096), (1000, 7168), (4096, 2048)])
def test_matches_reference_bit_for_bit(dtype, rows, hidden):
    rng = np.random.default_rng()
    x32 = _random_activations(rng, rows, hidden)
    if dtype == "bf16":
        host = x32.astype(ml_dtypes.bfloat16)
        dev = cp.asarray(host.view(np.uint16))
    else:
        host = x32
        dev = cp.asarray(host)
    q, sf = _poisoned_outputs(rows, hidden)
    q_out, sf_out = megamoe_rt.quantize_fp8(dev, out=q, out_sf=sf)
    assert q_out is q and sf_out is sf
    ref_q, ref_sf = reference.quantize_act_1x128(host)
    got_q = cp.asnumpy(q)
    got_sf = cp.asnumpy(sf)
    assert np.array_equal(got_sf.view(np.uint32), ref_sf.astype(np.float32).view(np.uint32))
    assert np.array_equal(got_q, ref_q.view(np.uint8))


def test_allocates_outputs_and_is_deterministic():
    rng = np.random.default_rng()
    x = cp.asarray(_random_activations(rng, 333, 1024))
    q1, sf1 = megamoe_rt.quantize_fp8(x)
    q2, sf2 = megamoe_rt.quantize_fp8(x)
    assert q1.dtype == cp.uint8 and q1.shape == (333, 1024)
    assert sf1.dtype == cp.float32 and sf1.shape == (333, 8)
    assert bool((q1 == q2).all()) and bool((sf1 == sf2).all())


def test_zero_rows():
    q, sf = megamoe_rt.quantize_fp8(cp.zeros((0, 256), dtype=cp.float32))
    assert q.shape == (0, 256) and sf.shape == (0, 2)


def test_runs_on_the_given_stream():
    rng = np.random.default_rng()
    host = _random_activations(rng, 512, 2048)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.asarray(host)
        q, sf = _poisoned_outputs(512, 2048)
        megamoe_rt.quantize_fp8(x, out=q, out_sf=sf, stream=s)
    s.synchronize()
    ref_q, _ = reference.quantize_act_1x128(host)
    assert np.array_equal(cp.asnumpy(q), ref_q.view(np.uint8))


def test_bad_inputs_raise_before_launch():
    with pytest.raises(ValueError, match="x: hidden size 200"):
        megamoe_rt.quantize_fp8(cp.ones((4, 200), dtype=cp.float32))
    with pytest.raises(TypeError, match="x: dtype int32"):
        megamoe_rt.quantize_fp8(cp.ones((4, 256), dtype=cp.int32))
    with pytest.raises(ValueError, match="x: expected a 2-d"):
        megamoe_rt.quantize_fp8(cp.ones((4, 2, 128), dtype=cp.float32))
    with pytest.raises(ValueError, match="out: expected shape"):
        megamoe_rt.quantize_fp8(cp.ones((4, 256), dtype=cp.float32), out=cp.empty((4, 128), cp.uint8))
    with pytest.raises(ValueError, match="x: expected a C-contiguous"):
        megamoe_rt.quantize_fp8(cp.ones((256, 8), dtype=cp.float32).T)


def test_torch_bfloat16_via_dlpack():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    t = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda") * 3
    q, sf = megamoe_rt.quantize_fp8(t)
    host = t.float().cpu().numpy().astype(ml_dtypes.bfloat16)
    ref_q, ref_sf = reference.quantize_act_1x128(host)
    assert np.array_equal(cp.asnumpy(q), ref_q.view(np.uint8))
    assert np.array_equal(cp.asnumpy(sf), ref_sf)


@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("shape", [(128, 128), (3, 256, 512), (2, 4096, 384)])
def test_weight_quantizer_matches_reference_bit_for_bit(dtype, shape):
    rng = np.random.default_rng()
    w32 = (rng.standard_normal(shape) * np.exp2(rng.integers(-10, 4, size=shape[:-1] + (1,)))).astype(np.float32)
    w32[..., :128, :128] = 0.0  # an all-zero block takes the floor scale
    host = w32.astype(ml_dtypes.bfloat16) if dtype == "bf16" else w32
    dev = cp.asarray(host.view(np.uint16)) if dtype == "bf16" else cp.asarray(host)
    q, sf = megamoe_rt.quantize_weight_fp8(dev)
    ref_q, ref_sf = reference.quantize_weight_128x128(host)
    assert np.array_equal(cp.asnumpy(sf), ref_sf)
    assert np.array_equal(cp.asnumpy(q), ref_q.view(np.uint8))
