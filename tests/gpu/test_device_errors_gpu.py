"""Inputs refused on the device: the call never waits, the slot is dropped, and the error is
raised later by the layer (next call, check(), synchronize()), once (needs a Hopper GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BF16_NAN = 0x7FC1
H, I, E, K, T = 512, 256, 8, 4, 64


@pytest.fixture(params=["unfused", "fused"])
def mode(request):
    return request.param


def _setup(mode, **kw):
    from megamoe_rt import MegaMoE

    rng = np.random.default_rng()
    inp = ref.random_moe_inputs(rng, T, H, I, E, K)
    layer = MegaMoE(H, I, E, K, T, mode=mode, **kw)
    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    dev = [cp.asarray(inp["x"].view(np.uint8)), cp.asarray(inp["x_sf"]), None, cp.asarray(inp["topk_weights"])]
    return layer, inp, dev


def _call(layer, dev, idx, stream=None):
    out = cp.full((T, H), BF16_NAN, dtype=cp.uint16)
    layer(dev[0], dev[1], idx, dev[3], out=out, stream=stream)
    return out


def _reference(inp, idx):
    y = ref.moe_forward(
        inp["x"], inp["x_sf"], idx, inp["topk_weights"], inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"]
    )
    return y.astype(np.float32)


def _bf16(bits):
    return (np.asarray(cp.asnumpy(bits), np.uint32) << 16).view(np.float32)


def test_out_of_range_id_is_dropped_then_raised_by_synchronize(mode):
    layer, inp, dev = _setup(mode)
    idx = inp["topk_idx"].copy()
    idx[3, 1] = E
    idx[9, 2] = -7
    y = _call(layer, dev, cp.asarray(idx))  # returns without raising: nothing waited
    with pytest.raises(
        ValueError, match=r"topk_idx: expert id outside \[-1, 8\) \(e.g. topk_idx\[(3, 1\] = 8|9, 2\] = -7)\)"
    ):
        layer.synchronize()
    clean = idx.copy()
    clean[3, 1] = clean[9, 2] = -1
    assert ref.calc_diff(_bf16(y), _reference(inp, clean)) < 1e-3
    # The layer computes exactly what it computes for the slots left empty.
    assert (cp.asnumpy(y) == cp.asnumpy(_call(layer, dev, cp.asarray(clean)))).all()
    layer.synchronize()  # raised once: nothing left


def test_repeated_id_is_raised_by_the_next_call_which_launches_nothing(mode):
    from megamoe_rt import DeviceInputError

    layer, inp, dev = _setup(mode)
    idx = inp["topk_idx"].copy()
    idx[5] = [3, 1, 3, 3]
    y = _call(layer, dev, cp.asarray(idx))
    cp.cuda.Device().synchronize()  # the failing call has finished: the next call sees its report
    nxt = cp.full((T, H), BF16_NAN, dtype=cp.uint16)
    with pytest.raises(DeviceInputError, match=r"topk_idx\[5, [23]\] = 3 repeats an earlier slot of token 5") as info:
        layer(dev[0], dev[1], cp.asarray(inp["topk_idx"]), dev[3], out=nxt)
    assert [f.kind for f in info.value.findings] == ["repeated_expert_id"]
    cp.cuda.Device().synchronize()
    assert (cp.asnumpy(nxt) == BF16_NAN).all(), "a call that raised must not launch"
    clean = idx.copy()
    clean[5] = [3, 1, -1, -1]  # the first occurrence is kept
    assert ref.calc_diff(_bf16(y), _reference(inp, clean)) < 1e-3
    good = _call(layer, dev, cp.asarray(inp["topk_idx"]))
    layer.synchronize()
    assert ref.calc_diff(_bf16(good), _reference(inp, inp["topk_idx"])) < 1e-3


def test_int64_ids_past_32_bits_are_reported_saturated(mode):
    layer, inp, dev = _setup(mode)
    idx = inp["topk_idx"].astype(np.int64)
    idx[0, 0] = (1 << 40) + 2  # would alias expert 2 if truncated to 32 bits
    _call(layer, dev, cp.asarray(idx))
    with pytest.raises(ValueError, match=r"topk_idx\[0, 0\] = 2147483647"):
        layer.synchronize()


def test_check_does_not_wait_and_reports_once(mode):
    layer, inp, dev = _setup(mode)
    layer.check()  # nothing reported yet
    idx = inp["topk_idx"].copy()
    idx[1, 0] = 100
    _call(layer, dev, cp.asarray(idx))
    cp.cuda.Device().synchronize()
    with pytest.raises(ValueError, match="outside"):
        layer.check()
    layer.check()
    layer.synchronize()


def test_validate_ids_false_drops_silently(mode):
    layer, inp, dev = _setup(mode, validate_ids=False)
    idx = inp["topk_idx"].copy()
    idx[2, 3] = E + 5
    y = _call(layer, dev, cp.asarray(idx))
    layer.synchronize()
    clean = idx.copy()
    clean[2, 3] = -1
    assert ref.calc_diff(_bf16(y), _reference(inp, clean)) < 1e-3


def test_debug_raises_from_the_failing_call(mode):
    layer, inp, dev = _setup(mode, debug=True)
    idx = inp["topk_idx"].copy()
    idx[0, 0] = 1000
    with pytest.raises(ValueError, match=r"topk_idx\[0, 0\] = 1000"):
        _call(layer, dev, cp.asarray(idx))
    y = _call(layer, dev, cp.asarray(inp["topk_idx"]))
    assert ref.calc_diff(_bf16(y), _reference(inp, inp["topk_idx"])) < 1e-3


def test_graph_replay_reports_after_the_replay(mode):
    layer, inp, dev = _setup(mode)
    stream = cp.cuda.Stream(non_blocking=True)
    idx = cp.asarray(inp["topk_idx"])
    out = cp.full((T, H), BF16_NAN, dtype=cp.uint16)
    with stream:
        layer(dev[0], dev[1], idx, dev[3], out=out, stream=stream)  # kernels load outside capture
        stream.synchronize()
        stream.begin_capture()
        layer(dev[0], dev[1], idx, dev[3], out=out, stream=stream)
        graph = stream.end_capture()
        bad = inp["topk_idx"].copy()
        bad[7, 0] = -2
        idx[...] = cp.asarray(bad)
        graph.launch(stream=stream)
        stream.synchronize()
    with pytest.raises(ValueError, match=r"topk_idx\[7, 0\] = -2"):
        layer.check()
    with stream:
        idx[...] = cp.asarray(inp["topk_idx"])
        out.fill(BF16_NAN)
        graph.launch(stream=stream)
        stream.synchronize()
    layer.check()
    assert ref.calc_diff(_bf16(out), _reference(inp, inp["topk_idx"])) < 1e-3


_SLEEP = r"""
extern "C" __global__ void sleep_ms(unsigned ms) {
    for (unsigned i = 0; i < ms; ++i) __nanosleep(1000000);
}
"""


@pytest.mark.parametrize("validate_ids", [True, False])
def test_a_call_does_not_wait_for_the_device(mode, validate_ids):
    import time

    layer, inp, dev = _setup(mode, validate_ids=validate_ids)
    idx = cp.asarray(inp["topk_idx"])
    stream = cp.cuda.Stream(non_blocking=True)
    _call(layer, dev, idx, stream=stream)  # kernels load and plans build outside the timing
    stream.synchronize()
    sleep = cp.RawKernel(_SLEEP, "sleep_ms")
    with stream:
        sleep((1,), (1,), (np.uint32(500),))
        start = time.perf_counter()
        _call(layer, dev, idx, stream=stream)
        elapsed = time.perf_counter() - start
        busy = not stream.done
    stream.synchronize()
    layer.synchronize()
    assert busy, "the stream finished during the call: the call waited for the device"
    assert elapsed < 0.25, f"the call took {elapsed * 1e3:.0f} ms behind a 500 ms kernel"
