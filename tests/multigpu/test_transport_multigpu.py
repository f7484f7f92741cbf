"""The unfused layer across ranks with each transport (cuda_src/ep/transport.cuh): NVSHMEM's
device API forced (it runs over NVLink on one node) gives the bits of the peer-pointer
transport, with the whole pool and with a ring of several windows, over repeated calls and a
graph replay; "auto" picks peer pointers where every rank maps every other (needs two Hopper
GPUs and nvshmem4py)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.ep.launch import spawn
from tests.conftest import TEST_RANKS as WORLD
from tests.helpers.layer_calls import BF16_NAN, replay_captured
from tests.multigpu.test_ep_multigpu import E, H, I, K, _tokens, rank_call_inputs

pytestmark = pytest.mark.multigpu


def _transports_rank(ctx, tokens_per_rank, seed):
    import cupy as cp

    from megamoe_rt import MegaMoE

    args, inp, local = rank_call_inputs(ctx, tokens_per_rank, seed)
    t = tokens_per_rank[ctx.rank]
    outs, chosen = {}, None
    cases = {
        "auto": dict(transport="auto"),
        "nvlink": dict(transport="nvlink"),
        "nvshmem": dict(transport="nvshmem"),
        "nvshmem ring": dict(transport="nvshmem", chunk_ratio=0.25),
    }
    for name, kw in cases.items():
        layer = MegaMoE(H, I, E, K, max(tokens_per_rank), mode="unfused", group=ctx, **kw)
        if name == "auto":
            chosen = layer.transport
        layer.load_weights(inp["w1"][local], inp["w1_sf"][local], inp["w2"][local], inp["w2_sf"][local])
        for _ in range(3):  # repeated calls: the banks' launch parity
            out = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
            layer(*args, out=out)
        outs[name] = cp.asnumpy(out)
        if name == "nvshmem":  # captured once, replayed
            replayed = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
            replay_captured(layer, args, replayed)
            outs["nvshmem graph"] = cp.asnumpy(replayed)
        ctx.barrier()
        layer.close()
    from megamoe_rt.ep.symm import NvshmemRuntime

    NvshmemRuntime.initialize(ctx).finalize()
    return chosen, outs


def test_the_nvshmem_transport_gives_the_peer_pointer_bits():
    for chosen, outs in spawn(_transports_rank, WORLD, args=(_tokens(300, 111), 9), timeout=900):
        assert chosen == "nvlink"
        assert not (outs["nvlink"] == BF16_NAN).any()
        for name in ("auto", "nvshmem", "nvshmem ring", "nvshmem graph"):
            np.testing.assert_array_equal(outs[name], outs["nvlink"], err_msg=name)
