"""Streamed calls across ranks (needs two Hopper GPUs and nvshmem4py): every rank produces its
own tokens into its input ring while the layer consumes every rank's chunks; the result must be
the batch call's, bit for bit, with uneven ranks (one without tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.ep.launch import spawn
from tests.conftest import TEST_RANKS as WORLD

pytestmark = pytest.mark.multigpu

H, I, K = 512, 256, 4
E = 8 * WORLD
BF16_NAN = 0x7FC1


def _stream_rank(ctx, tokens_per_rank, slots, tokens_per_slot, seed):
    import cupy as cp

    from megamoe_rt import MegaMoE
    from megamoe_rt import reference as ref
    from megamoe_rt.ep.symm import NvshmemRuntime
    from megamoe_rt.streaming import ChunkWriter, StreamConfig

    cp.cuda.Device(ctx.device).use()
    el = E // ctx.world_size
    local = slice(ctx.rank * el, (ctx.rank + 1) * el)
    w = ref.random_moe_inputs(np.random.default_rng(seed), 1, H, I, E, K)
    cap = max(tokens_per_rank)
    streamed = MegaMoE(H, I, E, K, cap, group=ctx, streaming=StreamConfig(slots, tokens_per_slot))
    batch = MegaMoE(H, I, E, K, cap, mode="unfused", group=ctx)
    for layer in (streamed, batch):
        layer.load_weights(w["w1"][local], w["w1_sf"][local], w["w2"][local], w["w2_sf"][local])
    writer = ChunkWriter(streamed)
    t = tokens_per_rank[ctx.rank]
    outs = []
    for call in range(2):
        inp = ref.random_moe_inputs(np.random.default_rng(seed * 100 + ctx.rank * 10 + call), t, H, I, E, K)
        args = [cp.asarray(inp["x"].view(np.uint8)), cp.asarray(inp["x_sf"])]
        args += [cp.asarray(inp["topk_idx"]), cp.asarray(inp["topk_weights"])]
        cp.cuda.get_current_stream().synchronize()
        producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        y = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
        streamed.consume(t, out=y, stream=consumer, num_tokens_bound=cap)
        writer.write_all(*args, stream=producer)
        consumer.synchronize()
        want = cp.full((t, H), BF16_NAN, dtype=cp.uint16)
        batch(*args, out=want)
        cp.cuda.Device().synchronize()
        outs.append((cp.asnumpy(y), cp.asnumpy(want)))
    ctx.barrier()
    streamed.close()
    batch.close()
    NvshmemRuntime.initialize(ctx).finalize()
    return outs


@pytest.mark.parametrize("tokens", [(600, 300), (0, 500), (256, 256)])
def test_streamed_across_ranks_equals_batch(tokens):
    tokens = tokens + tuple(100 + 37 * r for r in range(2, WORLD))
    for outs in spawn(_stream_rank, WORLD, args=(tokens, 2, 128, 9), timeout=900):
        for got, want in outs:
            np.testing.assert_array_equal(got, want)
