"""Random layer configurations across ranks, every mode (needs Hopper GPUs and nvshmem4py).

The ranks draw one configuration from a shared seed (tests/helpers/random_configs.py): the
shape, options, a token count per rank (zero included) and a routing style; each rank then
routes its own tokens. Every mode that runs the shape (unfused and fused with the full pool and
with their smallest ring, split) must give bit-identical outputs on each rank, matching the
reference of the global layer on a sample of that rank's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.ep.launch import spawn
from tests.conftest import TEST_RANKS as WORLD
from tests.helpers.random_configs import (
    draw_config,
    layer_options,
    random_seeds,
    reference_output,
    routed_inputs,
    smallest_ring_arms,
)

pytestmark = pytest.mark.multigpu

SAMPLE = 64  # tokens per rank checked against the (host) reference


def _rank(ctx, seed):
    import cupy as cp

    from megamoe_rt import MegaMoE
    from megamoe_rt import reference as ref
    from megamoe_rt.ep.symm import NvshmemRuntime
    from tests.helpers.layer_calls import bf16, device_args, run_poisoned

    cp.cuda.Device(ctx.device).use()
    cfg = draw_config(np.random.default_rng(seed), ctx.world_size)
    hidden, intermediate, experts, topk = cfg["shape"]
    inp = routed_inputs(np.random.default_rng([seed, ctx.rank]), cfg, cfg["tokens"][ctx.rank])
    weights = ref.random_moe_inputs(np.random.default_rng([seed, 1 << 20]), 1, hidden, intermediate, experts, topk)
    el = experts // ctx.world_size
    local = slice(ctx.rank * el, (ctx.rank + 1) * el)
    for name in ("w1", "w1_sf", "w2", "w2_sf"):
        inp[name] = weights[name]
    args = device_args(inp)
    outs = {}
    for name, kw in smallest_ring_arms(hidden):
        layer = MegaMoE(hidden, intermediate, experts, topk, cfg["capacity"], group=ctx, **layer_options(cfg), **kw)
        layer.load_weights(inp["w1"][local], inp["w1_sf"][local], inp["w2"][local], inp["w2_sf"][local])
        outs[name] = run_poisoned(layer, args)
        layer.synchronize()
        ctx.barrier()
        layer.close()
    NvshmemRuntime.initialize(ctx).finalize()
    sample = slice(0, min(cfg["tokens"][ctx.rank], SAMPLE))
    first = next(iter(outs.values()))
    diff = float(ref.calc_diff(bf16(first[sample]), reference_output(inp, cfg, sample)))
    return {
        "cfg": cfg,
        "diff": diff if cfg["tokens"][ctx.rank] else 0.0,
        "finite": bool(np.isfinite(bf16(first)).all()),
        "mismatches": {name: int((out != first).sum()) for name, out in outs.items()},
    }


@pytest.mark.parametrize("seed", random_seeds(), ids=lambda s: f"seed{s}")
def test_a_random_configuration_across_ranks_gives_the_reference_in_every_mode_bit_for_bit(seed):
    for rank, got in enumerate(spawn(_rank, WORLD, args=(seed,), timeout=900)):
        where = f"MEGAMOE_RT_RANDOM_SEED={seed} rank {rank}: {got['cfg']}"
        assert got["finite"], f"{where}: rows left unwritten or non-finite"
        assert got["diff"] < 1e-3, f"{where}: differs from the reference (calc_diff {got['diff']:.2e})"
        assert not any(got["mismatches"].values()), f"{where}: modes differ from the first: {got['mismatches']}"
