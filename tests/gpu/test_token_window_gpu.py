"""Token windows on one GPU: a layer whose buffer holds a window of a call's tokens runs a long
call window by window and gives the bits of the layer sized for the whole call, in every mode,
eagerly and replayed from a graph; reports of refused ids name the caller's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.layer_calls import BF16_NAN, bf16, device_args, replay_with_new_inputs, run_poisoned

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

MODES = ("unfused", "fused", "split")


def _layer(h, i, e, k, cap, w, **kw):
    from megamoe_rt import MegaMoE

    layer = MegaMoE(h, i, e, k, cap, **kw)
    layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
    return layer


# hidden, intermediate, experts, topk, capacity, tokens, window
CASES = [
    (512, 256, 16, 6, 3000, 3000, 1024),  # three windows, the last partial
    (1024, 512, 32, 8, 2048, 1500, 256),  # a call shorter than the capacity: fewer windows' tokens
    (512, 256, 8, 2, 1000, 1000, 1),  # a window of one token
    (512, 256, 16, 4, 700, 700, 4096),  # a window above the capacity: one window
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h,i,e,k,cap,t,window", CASES, ids=lambda v: str(v))
def test_a_windowed_call_gives_the_bits_of_the_whole_call(mode, h, i, e, k, cap, t, window):
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    whole = _layer(h, i, e, k, cap, w, mode=mode)
    windowed = _layer(h, i, e, k, cap, w, mode=mode, token_window=window)
    assert windowed.layout.total_bytes <= whole.layout.total_bytes
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.05)
    inp["topk_idx"][: t // 2] = np.arange(k)  # skewed: half the tokens on the first k experts
    args = device_args(inp)
    want = run_poisoned(whole, args)
    np.testing.assert_array_equal(run_poisoned(windowed, args), want)
    if t <= 1024:
        exp = ref.moe_forward(
            inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"], w["w1"], w["w1_sf"], w["w2"], w["w2_sf"]
        )
        assert ref.calc_diff(bf16(want), exp.astype(np.float32)) < 1e-3
    # A smaller bound runs fewer windows, a call of no tokens none. The bound stays within the
    # capacity when the window is above it (one window).
    part = min(window // 2 + 1, t)
    small = [a[:part] for a in args]
    np.testing.assert_array_equal(run_poisoned(windowed, small, num_tokens_bound=part), run_poisoned(whole, small))
    assert run_poisoned(windowed, [a[:0] for a in args]).shape == (0, h)
    whole.close()
    windowed.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_windowed_call_replays_from_a_graph_with_new_inputs(mode):
    h, i, e, k, cap, window = 512, 256, 16, 6, 2048, 600
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    whole = _layer(h, i, e, k, cap, w, mode=mode)
    windowed = _layer(h, i, e, k, cap, w, mode=mode, token_window=window)
    args = device_args(ref.random_moe_inputs(rng, cap, h, i, e, k))
    out = cp.full((cap, h), BF16_NAN, dtype=cp.uint16)
    replay_with_new_inputs(
        windowed,
        args,
        out,
        lambda: device_args(ref.random_moe_inputs(rng, cap, h, i, e, k)),
        lambda now: run_poisoned(whole, now),
    )


def test_a_refused_id_in_a_later_window_is_reported_at_the_callers_token():
    from megamoe_rt.runtime.errors import DeviceInputError

    h, i, e, k, cap, window = 512, 256, 16, 4, 3000, 1024
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    layer = _layer(h, i, e, k, cap, w, mode="fused", token_window=window)
    inp = ref.random_moe_inputs(rng, cap, h, i, e, k)
    inp["topk_idx"][2500, 2] = e + 7  # in the third window, its token 452
    run_poisoned(layer, device_args(inp))
    with pytest.raises(DeviceInputError, match=r"topk_idx\[2500, 2\] = 23"):
        layer.synchronize()


def test_the_memory_report_names_the_window_and_the_buffer_without_it():
    h, i, e, k = 4096, 2048, 32, 6
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    layer = _layer(h, i, e, k, 131072, w, mode="unfused", token_window=16384)
    report = layer.memory_report()
    assert "token window: 16384 tokens per rank" in report and "up to 8 windows" in report
    assert layer.layout.total_bytes < 4 * 2**30
