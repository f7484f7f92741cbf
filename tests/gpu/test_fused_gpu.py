"""The fused mode's ring pools, schedules, launch-parity banks and deadlines (needs a Hopper GPU).

The ring only changes where rows live, never what is computed for them, so a fused layer
with the schedule's ring and one whose ring is the whole worst-case pool (never wraps) must
agree bit for bit, on every launch, whatever the routing and whichever order a call's
``num_tokens_bound`` picks.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.traps import WITHHOLD_HOOK, check_withheld, trap_script

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

BF16_NAN = 0x7FC1


def _bf16(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def _skewed_inputs(rng, t, h, i, e, k, hot_share):
    """Routing where a share of the tokens all pick the same few experts (long units, wraps)."""
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.05)
    hot = rng.random(t) < hot_share
    inp["topk_idx"][hot] = (np.arange(k) + rng.integers(0, 2)) % e
    return inp


def _run(layer, inp, bound):
    x = cp.asarray(inp["x"].view(np.uint8))
    out = cp.full((x.shape[0], layer.hidden), BF16_NAN, dtype=cp.uint16)
    layer(
        x,
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
        out=out,
        num_tokens_bound=bound,
    )
    return cp.asnumpy(out)


# hidden, intermediate, experts, topk, capacity, tokens of the four launches
RING_SHAPES = [
    (512, 256, 16, 6, 2048, (2048, 1500, 2048, 700)),  # ring 148 of 207 blocks: wraps at the capacity
    (512, 256, 16, 6, 2048, (1024, 1023, 1, 1024)),  # bounds whose worst case fits: single wave
    (1024, 512, 8, 8, 4096, (4096, 4000, 100, 4096)),  # top-8 of 8: every token everywhere
    (512, 512, 32, 4, 4096, (4096, 3000, 4096, 2500)),
    (1024, 256, 48, 6, 8192, (8192, 5000, 8192, 64)),  # many experts, short units
    (512, 256, 4, 2, 8192, (8192, 8192, 4000, 8192)),  # few experts, long units: lag ring wraps often
    (768, 384, 16, 6, 1536, (1536, 1536, 900, 1536)),  # bound near the single-wave threshold
    (512, 256, 16, 6, 2048, (1200, 1100, 1200, 1000)),  # bounds just past the threshold: lag order
]


@pytest.mark.parametrize("h,i,e,k,cap,ts", RING_SHAPES, ids=lambda v: str(v))
def test_ring_matches_full_pool_bitwise_over_back_to_back_launches(h, i, e, k, cap, ts):
    from megamoe_rt import MegaMoE
    from megamoe_rt.testing import fused_schedule_of

    rng = np.random.default_rng()
    ring = MegaMoE(h, i, e, k, cap, mode="fused")
    w = ref.random_moe_inputs(rng, 1, h, i, e, k)
    ring.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
    full_blocks = fused_schedule_of(ring).full_pool_blocks
    full = MegaMoE(h, i, e, k, cap, mode="fused", ring_blocks=full_blocks)
    full.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
    assert ring.layout.pool_blocks < full.layout.pool_blocks or ring.layout.pool_blocks == full_blocks
    for n, t in enumerate(ts):
        inp = _skewed_inputs(rng, t, h, i, e, k, hot_share=0.3 * (n % 2))
        inp.update({name: w[name] for name in ("w1", "w1_sf", "w2", "w2_sf")})
        # Both layers under the capacity bound, then again under this call's own bound.
        a = _run(ring, inp, None)
        b = _run(full, inp, None)
        c = _run(ring, inp, t)
        d = _run(full, inp, t)
        assert np.array_equal(a, b), f"launch {n}: ring and full pool differ"
        assert np.array_equal(a, c) and np.array_equal(a, d), f"launch {n}: num_tokens_bound changed the result"
        if n == 0:
            sub = slice(0, min(t, 96))  # the float64 reference is slow: check a slice of tokens
            small = {key: (v[sub] if key in ("x", "x_sf", "topk_idx", "topk_weights") else v) for key, v in inp.items()}
            assert ref.calc_diff(_bf16(a[sub]), ref.moe_forward(**_ref_args(small)).astype(np.float32)) < 1e-3


def _ref_args(inp):
    return dict(
        x=inp["x"],
        x_sf=inp["x_sf"],
        topk_idx=inp["topk_idx"],
        topk_weights=inp["topk_weights"],
        w1=inp["w1"],
        w1_sf=inp["w1_sf"],
        w2=inp["w2"],
        w2_sf=inp["w2_sf"],
    )


def test_fused_and_unfused_agree():
    from megamoe_rt import MegaMoE

    rng = np.random.default_rng()
    h, i, e, k, t = 1024, 512, 16, 6, 1000
    inp = ref.random_moe_inputs(rng, t, h, i, e, k, empty_slot_prob=0.1)
    outs = {}
    for mode in ("unfused", "fused"):
        layer = MegaMoE(h, i, e, k, t, mode=mode)
        layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
        outs[mode] = _bf16(_run(layer, inp, None))
    assert ref.calc_diff(outs["unfused"], outs["fused"]) < 1e-5


def test_bound_and_ring_arguments_are_checked():
    from megamoe_rt import MegaMoE

    rng = np.random.default_rng()
    h, i, e, k, t = 512, 256, 8, 2, 64
    inp = ref.random_moe_inputs(rng, t, h, i, e, k)
    layer = MegaMoE(h, i, e, k, 128, mode="fused")
    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    with pytest.raises(ValueError, match="num_tokens_bound=63: expected at least this call's 64 tokens"):
        _run(layer, inp, 63)
    with pytest.raises(ValueError, match="num_tokens_bound=129"):
        _run(layer, inp, 129)
    with pytest.raises(TypeError, match="num_tokens_bound"):
        _run(layer, inp, 64.0)
    with pytest.raises(ValueError, match="hidden=384: mode='fused' needs a multiple of 256"):
        MegaMoE(384, 256, 8, 2, 64, mode="fused")
    with pytest.raises(ValueError, match="ring_blocks"):
        MegaMoE(512, 256, 16, 6, 8192, mode="fused", ring_blocks=50)
    with pytest.raises(ValueError, match="mode"):
        MegaMoE(512, 256, 8, 2, 64, mode="split-ish")
    # The default is the fused mode wherever its tile fits the shape.
    assert MegaMoE(512, 256, 8, 2, 64).mode == "fused"
    assert MegaMoE(384, 256, 8, 2, 64).mode == "unfused"
    report = layer.memory_report()
    assert (
        f"fused pools: full pool of {layer.layout.pool_blocks} blocks" in report and "lag" in report
    )  # 128 tokens: the ring covers the pool


_WITHHELD = trap_script(256, 512, 256, 8, 2, 0.5, "", WITHHOLD_HOOK)

# What a bound below a peer's count does across ranks: a single wave larger than the ring.
_OVERFLOW = trap_script(
    2048,
    512,
    256,
    16,
    6,
    1.0,
    """
    from megamoe_rt.modes.fused import CallSchedule
    full = testing.fused_schedule_of(layer).full_pool_blocks
    assert layer.layout.pool_blocks < 192 <= full
    single_wave = CallSchedule(True, full, 4)
""",
    "testing.force_call_schedule(layer, single_wave)",
)


def test_a_single_wave_larger_than_the_ring_traps_with_a_message():
    out = subprocess.run([sys.executable, "-c", _OVERFLOW], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert "single-wave call needs" in text and "num_tokens_bound must cover" in text, text


@pytest.mark.parametrize("block,finishes", [(0, False), (0xFFFFFFFF, True)])
def test_a_withheld_arrival_traps_naming_the_wait(block, finishes):
    check_withheld(_WITHHELD, block, finishes, "L1 rows arrived")
