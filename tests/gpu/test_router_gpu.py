"""The reference router (megamoe_rt/routers.py) against NumPy: its float32 gating product, its
top-k (largest first, ties to the lower expert) with renormalised softmax weights, and its
activations, which must be the bytes quantize_fp8 gives."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _expected_routes(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    t, e = logits.shape
    idx = np.stack([np.lexsort((np.arange(e), -row))[:k] for row in logits]).astype(np.int32)
    top = np.take_along_axis(logits, idx, axis=1).astype(np.float64)
    p = np.exp(top - logits.max(axis=1, keepdims=True))
    return idx, p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize(
    "tokens,hidden,experts,k",
    [(100, 512, 16, 4), (37, 1024, 40, 6), (64, 896, 256, 8), (9, 128, 3, 1), (300, 7168, 64, 8)],
)
def test_route_batch_matches_numpy(tokens, hidden, experts, k):
    from megamoe_rt import quantize_fp8
    from megamoe_rt.routers import Router

    rs = cp.random.RandomState(tokens * experts)
    h = rs.standard_normal((tokens, hidden), dtype=cp.float32)
    gate = rs.standard_normal((hidden, experts), dtype=cp.float32) / 16
    if experts > 8:  # exact ties: two experts with the same column give the same logits
        gate[:, 5] = gate[:, 2]
    router = Router(experts, k)
    x, x_sf, idx, w, logits = router.route_batch(h, gate)
    q, q_sf = quantize_fp8(h)
    want_logits = cp.asnumpy(h).astype(np.float64) @ cp.asnumpy(gate).astype(np.float64)
    got_logits = cp.asnumpy(logits)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    want_idx, want_w = _expected_routes(got_logits, k)  # the selection, from the router's own logits
    np.testing.assert_array_equal(cp.asnumpy(idx), want_idx)
    np.testing.assert_allclose(cp.asnumpy(w), want_w, rtol=1e-5, atol=1e-7)
    assert cp.array_equal(x, q) and cp.array_equal(x_sf, q_sf)
    # Routing alone from the same logits gives the same bits.
    idx2, w2 = cp.full_like(idx, -7), cp.full_like(w, cp.nan)
    router.route_all(logits, idx2, w2)
    assert cp.array_equal(idx2, idx) and cp.array_equal(w2, w)


def test_router_inputs_are_checked_before_any_launch():
    from megamoe_rt.routers import Router

    router = Router(16, 2)
    h = cp.ones((8, 256), cp.float32)
    with pytest.raises(ValueError, match=r"gate: shape \[256, 8\], expected \[256, 16\]"):
        router.route_batch(h, cp.ones((256, 8), cp.float32))
    with pytest.raises(TypeError, match="hidden: expected a 2-D float32 CuPy array"):
        router.route_batch(h.astype(cp.float64), cp.ones((256, 16), cp.float32))
    with pytest.raises(ValueError, match="hidden: expected a C-contiguous"):
        router.route_batch(cp.ones((256, 8), cp.float32).T, cp.ones((256, 16), cp.float32))
    with pytest.raises(ValueError, match=r"hidden: shape \[8, 200\]"):
        router.route_batch(cp.ones((8, 200), cp.float32), cp.ones((200, 16), cp.float32))
    with pytest.raises(ValueError, match="num_experts=0"):
        Router(0, 2)
    with pytest.raises(ValueError, match="num_experts=1025"):
        Router(1025, 2)
    with pytest.raises(ValueError, match="num_topk=17"):
        Router(16, 17)


def test_route_batch_in_several_launches_gives_the_same_bits(monkeypatch):
    import megamoe_rt.routers as routers

    rs = cp.random.RandomState(3)
    h = rs.standard_normal((203, 512), dtype=cp.float32)
    gate = rs.standard_normal((512, 24), dtype=cp.float32) / 16
    router = routers.Router(24, 5)
    whole = router.route_batch(h, gate)
    monkeypatch.setattr(routers, "BATCH_TOKENS", 40)  # 6 launches, the last one partial
    for a, b in zip(whole, router.route_batch(h, gate)):
        assert cp.array_equal(a, b)


def test_a_slot_the_layer_never_releases_traps_the_router_at_the_layers_deadline():
    """Two slots, five chunks and no consumer: the router's second round waits for slots the
    layer never releases and must trap on the layer's deadline (1 s here), naming the slot."""
    import subprocess
    import sys
    import textwrap

    from tests.helpers.traps import SYNC_AND_REPORT

    script = (
        textwrap.dedent("""
        import sys, time
        import cupy as cp
        from megamoe_rt import MegaMoE
        from megamoe_rt import reference as ref
        from megamoe_rt.routers import Router
        from megamoe_rt.runtime import driver
        from megamoe_rt.streaming import StreamConfig
        from cuda.bindings import driver as cu
        w = ref.random_moe_inputs(0, 1, 512, 256, 16, 4)
        layer = MegaMoE(512, 256, 16, 4, 1024, streaming=StreamConfig(2, 128), timeout_s=1.0)
        layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
        router = Router(16, 4, layer)
        rs = cp.random.RandomState(5)
        hidden = rs.standard_normal((600, 512), dtype=cp.float32)
        gate = rs.standard_normal((512, 16), dtype=cp.float32) / 16
        stream = cp.cuda.Stream(non_blocking=True)
        router.warm(hidden, gate, stream)
        start = time.monotonic()
        router.produce(hidden, gate, stream)  # nobody consumes
        try:
            stream.synchronize()
        finally:
            print(f"waited {time.monotonic() - start:.2f} s")
    """)
        + SYNC_AND_REPORT
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "finished" not in out.stdout, text
    # Chunks 2 and 3 wait at once (a thread each): the report names whichever timed out first.
    named = re.search(r"wait 'stream slot free' timed out after 1\.0 s: slot (\d) \(chunk (\d)\)", text)
    assert named is not None, text
    slot, chunk = (int(g) for g in named.groups())
    assert chunk in (2, 3) and slot == chunk - 2, text
    waited = float(text.split("waited ")[1].split(" s")[0])
    assert 0.9 < waited < 30, text
