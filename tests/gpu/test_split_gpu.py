"""The split mode (K1 | K2 in green-context partitions, K3 after, one CUDA graph) on one GPU.

Split, fused and unfused run the same tiles with the same epilogues and the same slot-order
reduce, so their outputs must agree bit for bit, and all must match the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.layer_calls import BF16_NAN, bf16, device_args, run_poisoned
from tests.helpers.traps import WITHHOLD_HOOK, check_withheld, trap_script

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _layers(h, i, e, k, cap, w, modes=("split", "fused", "unfused"), **kw):
    from megamoe_rt import MegaMoE

    out = {}
    for m in modes:
        layer = MegaMoE(h, i, e, k, cap, mode=m, **(kw if m == "split" else {}))
        layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
        out[m] = layer
    return out


def _reference(inp, w):
    return ref.moe_forward(
        inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"], w["w1"], w["w1_sf"], w["w2"], w["w2_sf"]
    ).astype(np.float32)


# hidden, intermediate, experts, topk, capacity, tokens (the fused tests' grid and more)
SHAPES = [
    (512, 256, 8, 2, 128, 128),
    (1024, 512, 32, 6, 1024, 1000),
    (4096, 2048, 8, 8, 7, 7),
    (7168, 3072, 1, 1, 1, 1),
    (7168, 2048, 8, 6, 64, 64),
    (512, 256, 48, 8, 4096, 4096),
    (1024, 256, 48, 6, 256, 0),
    (512, 256, 4, 2, 8192, 8192),  # few experts, long units
    (4096, 2048, 32, 6, 2048, 2048),  # flash-like per-rank slice
]


@pytest.mark.parametrize("h,i,e,k,cap,t", SHAPES, ids=lambda v: str(v))
def test_split_matches_reference_and_is_bitwise_fused_and_unfused(h, i, e, k, cap, t):
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    layers = _layers(h, i, e, k, cap, w)
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.05)
    args = device_args(inp)
    ys = {m: run_poisoned(layer, args) for m, layer in layers.items()}
    np.testing.assert_array_equal(ys["split"], ys["fused"])
    np.testing.assert_array_equal(ys["split"], ys["unfused"])
    if t:
        assert ref.calc_diff(bf16(ys["split"]), _reference(inp, w)) < 1e-3


@pytest.mark.parametrize("sms", [(64, 64, 132), (96, 36, 132), (32, 100, 64), (120, 8, 16)], ids=str)
def test_every_split_the_device_allows_gives_the_same_bits(sms):
    h, i, e, k, t = 1024, 512, 16, 6, 2048
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    layers = _layers(h, i, e, k, t, w, modes=("split", "fused"), split_sms=sms)
    assert layers["split"].runner.sms.as_tuple() == sms
    inp = ref.random_moe_inputs(rng, t, h, i, e, k)
    inp["topk_idx"][: t // 3] = np.arange(k)  # a third of the tokens on the same experts
    args = device_args(inp)
    np.testing.assert_array_equal(run_poisoned(layers["split"], args), run_poisoned(layers["fused"], args))


def _traced_split_call(h, i, e, k, t, sms):
    """One traced call of a split layer (after a warm call it must match bit for bit): the
    stamps (rows: K1's blocks, K2's, K3's) and the column of each trace event."""
    from megamoe_rt.kernels import fused as fk
    from megamoe_rt.testing import trace_buffer

    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    split = _layers(h, i, e, k, t, w, modes=("split",), split_sms=sms)["split"]
    args = device_args(ref.random_moe_inputs(rng, t, h, i, e, k))
    want = run_poisoned(split, args)  # compile and warm
    with trace_buffer(split) as stamps:
        np.testing.assert_array_equal(run_poisoned(split, args), want)
    return cp.asnumpy(stamps).astype(np.int64), {name: n for n, name in enumerate(fk.TRACE_EVENTS)}


def test_k1_and_k2_stay_in_their_partitions_and_overlap():
    s, col = _traced_split_call(4096, 2048, 32, 6, 4096, (80, 52, 132))
    sm = col["sm"]
    k1_sms, k2_sms = set(s[:80, sm].tolist()), set(s[80:132, sm].tolist())
    assert len(k1_sms) == 80 and len(k2_sms) == 52, (len(k1_sms), len(k2_sms))
    assert not k1_sms & k2_sms
    start, done = col["start"], col["math_done"]
    k1 = (s[:80, start].min(), s[:80, done].max())
    k2 = (s[80:132, start].min(), s[80:132, done].max())
    # K2 starts before K1 is through its tiles: the two run concurrently.
    assert k2[0] < k1[1] and k1[0] < k2[1], (k1, k2)


def test_k3_runs_on_its_reduce_sms_after_k1_and_k2():
    s, col = _traced_split_call(1024, 512, 16, 6, 2048, (96, 36, 64))
    k3 = s[96 + 36 :]
    ran = k3[:, col["start"]] > 0
    assert ran.any()
    k3_sms = set(k3[ran, col["sm"]].tolist())
    assert len(k3_sms) <= 64, len(k3_sms)  # its own partition, not the whole device
    # The graph's edges: K3 starts once K1 and K2 are through their tiles.
    assert k3[ran, col["start"]].min() >= s[: 96 + 36, col["math_done"]].max()
    assert (k3[ran, col["combine_done"]] >= k3[ran, col["start"]]).all()


def test_twenty_replays_with_new_inputs_in_the_same_arrays():
    h, i, e, k, cap = 1024, 512, 16, 6, 1024
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    layers = _layers(h, i, e, k, cap, w, modes=("split", "fused"))
    split = layers["split"]
    first = ref.random_moe_inputs(rng, cap, h, i, e, k)
    args = device_args(first)
    out = cp.empty((cap, h), dtype=cp.uint16)
    graphs_before = None
    for n in range(20):
        inp = ref.random_moe_inputs(rng, cap, h, i, e, k, empty_slot_prob=0.1 * (n % 3))
        for dst, src in zip(args, device_args(inp)):
            dst[...] = src
        out.fill(BF16_NAN)
        split(*args, out=out)
        want = run_poisoned(layers["fused"], args)
        np.testing.assert_array_equal(cp.asnumpy(out), want, err_msg=f"replay {n}")
        graph = split.runner._graphs["int32"]
        if graphs_before is None:
            graphs_before = graph.args
        assert graph.args == graphs_before  # same arrays: nothing rewritten into the graph


def test_calls_captured_into_a_caller_graph_replay_with_new_inputs():
    h, i, e, k, cap = 512, 256, 8, 4, 512
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    layers = _layers(h, i, e, k, cap, w, modes=("split", "fused"))
    args = device_args(ref.random_moe_inputs(rng, cap, h, i, e, k))
    out = cp.empty((cap, h), dtype=cp.uint16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        layers["split"](*args, out=out, stream=stream)  # compile and build outside the capture
        stream.synchronize()
        graph = stream.begin_capture()
        layers["split"](*args, out=out, stream=stream)
        graph = stream.end_capture()
    for _ in range(3):
        inp = ref.random_moe_inputs(rng, cap, h, i, e, k)
        for dst, src in zip(args, device_args(inp)):
            dst[...] = src
        out.fill(BF16_NAN)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), run_poisoned(layers["fused"], args))


def test_pool_overflow_and_ring_and_int64_ids():
    h, i, e, k, cap = 512, 256, 16, 6, 2048
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    ring = _layers(h, i, e, k, cap, w, modes=("split",), ring_blocks=40)["split"]
    fused = _layers(h, i, e, k, cap, w, modes=("fused",))["fused"]
    assert ring.layout.pool_blocks == 40
    inp = ref.random_moe_inputs(rng, cap, h, i, e, k)
    inp["topk_idx"][: cap // 2] = np.arange(k)  # long units: the 40-block ring wraps many times
    args = device_args(inp)
    args[2] = args[2].astype(cp.int64)
    np.testing.assert_array_equal(run_poisoned(ring, args), run_poisoned(fused, args))


def test_bad_split_sms_are_refused_with_the_valid_choices():
    from megamoe_rt import MegaMoE

    with pytest.raises(ValueError, match=r"K1 gets 60 SMs.*multiple of 8.*8, 16, \.\.\., 112, 120"):
        MegaMoE(512, 256, 8, 2, 64, mode="split", split_sms=(60, 64, 132))
    with pytest.raises(ValueError, match=r"K2 gets 50 SMs.*all 36 left"):
        MegaMoE(512, 256, 8, 2, 64, mode="split", split_sms=(96, 50, 132))
    with pytest.raises(TypeError, match="split_sms"):
        MegaMoE(512, 256, 8, 2, 64, mode="split", split_sms=(96, 36))
    with pytest.raises(ValueError, match="only mode='split' takes SM counts"):
        MegaMoE(512, 256, 8, 2, 64, mode="fused", split_sms=(64, 64, 132))


_WITHHELD = trap_script(256, 512, 256, 8, 2, 0.5, "", WITHHOLD_HOOK, mode="split")


@pytest.mark.parametrize("block,finishes", [(0, False), (0xFFFFFFFF, True)])
def test_a_withheld_l1_readiness_makes_k2_trap_naming_the_wait(block, finishes):
    check_withheld(_WITHHELD, block, finishes, "L1 output published")


def test_chunk_ratio_sizes_the_ring_and_the_bits_do_not_change():
    h, i, e, k, cap = 512, 256, 16, 6, 4096
    rng = np.random.default_rng()
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    quarter = _layers(h, i, e, k, cap, w, modes=("split",), chunk_ratio=0.25)["split"]
    auto = _layers(h, i, e, k, cap, w, modes=("split",), chunk_ratio="auto")["split"]
    fused = _layers(h, i, e, k, cap, w, modes=("fused",))["fused"]
    full = quarter.runner.schedule.full_pool_blocks
    assert quarter.layout.pool_blocks == -(-full // 4)
    assert auto.layout.pool_blocks == full  # a small layer: the whole pool fits the budget
    inp = ref.random_moe_inputs(rng, cap, h, i, e, k)
    inp["topk_idx"][: cap // 2] = np.arange(k)
    args = device_args(inp)
    want = run_poisoned(fused, args)
    np.testing.assert_array_equal(run_poisoned(quarter, args), want)
    np.testing.assert_array_equal(run_poisoned(auto, args), want)
