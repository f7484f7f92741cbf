"""Ring pools across ranks (needs two Hopper GPUs and nvshmem4py).

Rings that wrap (fused, split: slots reused while peers still pull and scatter; unfused: the
pull and both GEMMs in cycles) and token windows (the whole buffer sized for a window, a call run
window by window) must give every rank the bits of the full-pool run, with uneven
ranks (one without tokens, one at the capacity) and at prefill sizes. The unfused mode records
the cycles of the call, the most of any rank, in the workspace word ``pool_cycles``.
"""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.ep.launch import spawn
from tests.conftest import TEST_RANKS as WORLD

pytestmark = pytest.mark.multigpu

BF16_NAN = 0x7FC1
BLOCK = 128  # unfused pool block rows


# name -> MegaMoE keyword arguments; the first is the full-pool run the others must match.
LAYERS = {
    "unfused full": dict(mode="unfused"),
    "unfused ring 1/4": dict(mode="unfused", chunk_ratio=0.25),
    "unfused ring 1/64": dict(mode="unfused", chunk_ratio=1 / 64),
    "fused ring 1.0": dict(mode="fused", chunk_ratio=1.0),
    "fused default ring": dict(mode="fused"),
    "fused smallest ring": dict(mode="fused", chunk_ratio=1e-6),
    "split ring 1/4": dict(mode="split", chunk_ratio=0.25),
    "split smallest ring": dict(mode="split", chunk_ratio=1e-6),
    # Token windows: every rank runs the windows of the agreed bound, a rank out of tokens none.
    "window 700 unfused": dict(mode="unfused", token_window=700),
    "window 1024 fused": dict(mode="fused", token_window=1024),
    "window 512 split ring 1/4": dict(mode="split", token_window=512, chunk_ratio=0.25),
}


def _rank_inputs(cp, rank, t, h, i, el, e, k, seed):
    """GPU-generated: this rank's tokens and routing over all e experts, and its el experts' weights."""
    from megamoe_rt import quantize_fp8, quantize_weight_fp8

    rs = cp.random.RandomState(seed * 100 + rank)
    if t:
        x, x_sf = quantize_fp8(rs.standard_normal((t, h), dtype=cp.float32))
    else:
        x, x_sf = cp.empty((0, h), dtype=cp.uint8), cp.empty((0, h // 128), dtype=cp.float32)
    idx = cp.argsort(rs.standard_normal((t, e)), axis=1)[:, :k].astype(cp.int32)
    idx[rs.random_sample((t, k)) < 0.05] = -1
    w = rs.random_sample((t, k)).astype(cp.float32) + 0.1
    w1, w1_sf = quantize_weight_fp8(rs.standard_normal((el, 2 * i, h), dtype=cp.float32) / 64)
    w2, w2_sf = quantize_weight_fp8(rs.standard_normal((el, h, i), dtype=cp.float32) / 64)
    return (x, x_sf, idx, w), (w1, w1_sf, w2, w2_sf)


def _ring_rank(ctx, shape, tokens_per_rank, names, seed):
    """Each named layer on this rank's inputs: its output, pool rows per cycle and recorded cycles."""
    import cupy as cp

    from megamoe_rt import MegaMoE

    cp.cuda.Device(ctx.device).use()
    h, i, el, k = shape
    e = el * ctx.world_size
    t = tokens_per_rank[ctx.rank]
    args, weights = _rank_inputs(cp, ctx.rank, t, h, i, el, e, k, seed)
    cap = max(tokens_per_rank)
    result = {"hist": np.bincount(cp.asnumpy(args[2]).ravel() + 1, minlength=e + 1)[1:]}
    for name in names:
        layer = MegaMoE(h, i, e, k, cap, group=ctx, **LAYERS[name])
        layer.load_weights(*weights)
        for _ in range(2):  # the second call runs on the other parity bank
            out = cp.full((t, h), BF16_NAN, dtype=cp.uint16)
            layer(*args, out=out)
        cp.cuda.runtime.deviceSynchronize()
        cycles = int(layer.buffer.view("pool_cycles")[0]) if name.startswith("unfused") else None
        result[name] = (cp.asnumpy(out), layer.layout.pool_rows, cycles)
        ctx.barrier()
        layer.close()
    from megamoe_rt.ep.symm import NvshmemRuntime

    NvshmemRuntime.initialize(ctx).finalize()
    return result


def _check(results, names, el):
    total = sum(r["hist"] for r in results)  # rows each global expert receives
    for name in names:
        ring_rows = results[0][name][1]
        for r in results:
            np.testing.assert_array_equal(r[name][0], r[names[0]][0], err_msg=name)
        if name.startswith("unfused"):
            per_rank = []
            for rank in range(len(results)):
                rows = sum(-(-int(c) // BLOCK) * BLOCK for c in total[rank * el : (rank + 1) * el])
                per_rank.append(max(1, -(-rows // ring_rows)))
            assert [r[name][2] for r in results] == [max(per_rank)] * len(results), name


def _tokens(first, second):
    return (first, second) + tuple(500 + 97 * r for r in range(2, WORLD))


@pytest.mark.parametrize("tokens", [_tokens(0, 3000), _tokens(3000, 1234), _tokens(2048, 2048)])
def test_wrapping_rings_across_ranks_give_the_full_pool_bits(tokens):
    names = list(LAYERS)
    shape = (512, 256, 8, 4)  # hidden, intermediate, experts per rank, top-k
    results = spawn(_ring_rank, WORLD, args=(shape, tokens, names, 3), timeout=900)
    _check(results, names, shape[2])
    assert any(r["unfused ring 1/64"][2] > 1 for r in results)  # the rings did wrap


@pytest.mark.parametrize("tokens", [_tokens(16384, 5000), _tokens(32768, 32768), _tokens(65536, 20000)])
def test_prefill_sized_calls_across_ranks_give_the_full_pool_bits(tokens):
    names = ["unfused full", "unfused ring 1/4", "fused default ring", "split ring 1/4"]
    shape = (4096, 2048, 32, 6)  # a flash-like EP8 slice on each rank
    results = spawn(_ring_rank, WORLD, args=(shape, tokens, names, 5), timeout=1200)
    _check(results, names, shape[2])
