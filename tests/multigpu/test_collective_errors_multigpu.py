"""Across ranks an error is raised on every rank alike, and the layers stay usable (needs two
Hopper GPUs and nvshmem4py).

Each scenario: a bad call on one rank (or disagreeing ranks), every rank checks the error it
got, then every rank runs a good call whose output is checked against the reference (the
launch parity and the buffers survived)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.ep.launch import spawn
from tests.multigpu.test_ep_multigpu import WORLD, E, H, I, K, _inputs

pytestmark = pytest.mark.multigpu
BF16_NAN = 0x7FC1


def _good_call_matches(layer, cp, ref, inp, t):
    args = _device_args(cp, inp)
    out = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
    layer(*args, out=out)
    layer.synchronize()
    got = (cp.asnumpy(out).astype(np.uint32) << 16).view(np.float32)
    if not t:
        return 0.0
    exp = ref.moe_forward(
        inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"], inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"]
    )
    return float(ref.calc_diff(got, exp.astype(np.float32)))


def _device_args(cp, inp):
    return (
        cp.asarray(inp["x"].view(np.uint8)),
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
    )


def _scenario(ctx, mode, what):
    import cupy as cp

    from megamoe_rt import DeviceInputError, MegaMoE
    from megamoe_rt import reference as ref
    from megamoe_rt.ep.symm import NvshmemRuntime

    cp.cuda.Device(ctx.device).use()
    t = 48
    layer = MegaMoE(H, I, E, K, 64, mode=mode, group=ctx, timeout_s=5.0)
    inp = _inputs(ctx.rank, t, "random", 5, weight_seed=5)
    el = E // ctx.world_size
    local = slice(ctx.rank * el, (ctx.rank + 1) * el)
    layer.load_weights(inp["w1"][local], inp["w1_sf"][local], inp["w2"][local], inp["w2_sf"][local])
    args = list(_device_args(cp, inp))
    bad_rank = 1
    message = ""
    # One rank's bad argument: (argument index, how to spoil it, the error on every rank, a word of it).
    spoil = {
        "bad_shape": (1, lambda a: a[:, :1].copy(), ValueError, "x_sf: expected shape"),
        "bad_dtype": (3, lambda a: a.astype(cp.float64), TypeError, "topk_weights"),
    }
    if what in spoil:
        index, spoiled, kind, word = spoil[what]
        if ctx.rank == bad_rank:
            args[index] = spoiled(args[index])
        try:
            layer(*args)
        except kind as exc:
            message = str(exc)
        assert "refused on rank 1" in message and word in message, message
    elif what == "bounds_differ":
        try:
            layer(*args, num_tokens_bound=48 + 2 * ctx.rank)  # within the capacity of 64 up to EP8
        except ValueError as exc:
            message = str(exc)
        assert "num_tokens_bound: ranks passed" in message, message
    elif what == "bad_ids":
        if ctx.rank == bad_rank:
            idx = inp["topk_idx"].copy()
            idx[2, 1] = E + 3
            args[2] = cp.asarray(idx)
        layer(*args)  # launches on every rank: the ids are checked on the device
        try:
            layer.synchronize()
        except DeviceInputError as exc:
            message = str(exc)
        assert "MegaMoE (rank 1)" in message and f"topk_idx[2, 1] = {E + 3}" in message, message
    texts = ctx.allgather(message.encode(), key="texts")
    assert len(set(texts)) == 1, texts  # the same error on every rank
    diff = _good_call_matches(layer, cp, ref, inp, t)
    ctx.barrier()
    layer.close()
    NvshmemRuntime.initialize(ctx).finalize()
    return diff


@pytest.mark.parametrize("mode", ["unfused", "fused"])
@pytest.mark.parametrize("what", ["bad_shape", "bad_dtype", "bounds_differ", "bad_ids"])
def test_every_rank_raises_the_same_error_and_the_layer_stays_usable(mode, what):
    diffs = spawn(_scenario, WORLD, args=(mode, what), timeout=600)
    assert all(d < 1e-3 for d in diffs), diffs
