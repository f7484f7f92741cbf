"""Random layer configurations through every mode that runs them (needs a Hopper GPU).

Each configuration draws a shape (hidden, intermediate, experts, top-k, tokens, capacity), the
requant options and a routing (uniform, skewed onto a few hot experts, empty slots, int32 or
int64 ids): tests/helpers/random_configs.py. Every mode that accepts the shape runs it: unfused
and fused with the full pool and with the smallest ring they take, split, and a streamed call.
Each output must match the reference forward, and all of them must be bit-identical.

The seed is new on every run and shown in a failure; ``MEGAMOE_RT_RANDOM_SEED`` replays one,
``MEGAMOE_RT_RANDOM_CONFIGS`` sets how many configurations a run draws (default 3).
"""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.layer_calls import BF16_NAN, bf16, device_args, run_poisoned
from tests.helpers.random_configs import (
    draw_config,
    layer_options,
    random_seeds,
    reference_output,
    routed_inputs,
    smallest_ring_arms,
)

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _arms(cfg: dict) -> list[tuple[str, dict]]:
    arms = smallest_ring_arms(cfg["shape"][0])
    tokens = cfg["tokens"][0]
    if tokens:
        from megamoe_rt.streaming import StreamConfig

        per_slot = max(1, min(cfg["capacity"], (tokens + 2) // 3))
        arms.append(("streamed", {"streaming": StreamConfig(1 + tokens % 3, per_slot)}))
    return arms


def _run_arm(kw: dict, cfg: dict, inp: dict, args: list) -> np.ndarray:
    from megamoe_rt import MegaMoE

    hidden, intermediate, experts, topk = cfg["shape"]
    layer = MegaMoE(hidden, intermediate, experts, topk, cfg["capacity"], **layer_options(cfg), **kw)
    try:
        layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
        if "streaming" not in kw:
            return run_poisoned(layer, args)
        from megamoe_rt.streaming import ChunkWriter

        tokens = cfg["tokens"][0]
        producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()
        out = cp.full((tokens, hidden), BF16_NAN, dtype=cp.uint16)
        layer.consume(tokens, out=out, stream=consumer)
        ChunkWriter(layer).write_all(*args, stream=producer)
        consumer.synchronize()
        producer.synchronize()
        return cp.asnumpy(out)
    finally:
        layer.synchronize()
        layer.close()


@pytest.mark.parametrize("seed", random_seeds(), ids=lambda s: f"seed{s}")
def test_a_random_configuration_gives_the_reference_in_every_mode_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    cfg = draw_config(rng)
    inp = routed_inputs(rng, cfg, cfg["tokens"][0])
    where = f"MEGAMOE_RT_RANDOM_SEED={seed}: {cfg}"
    expected = reference_output(inp, cfg)
    args = device_args(inp)
    first_name, first = None, None
    for name, kw in _arms(cfg):
        got = _run_arm(kw, cfg, inp, args)
        assert got.shape == expected.shape, f"{where}: {name} returned {got.shape}"
        if cfg["tokens"][0]:
            values = bf16(got)
            assert np.isfinite(values).all(), f"{where}: {name} left rows unwritten or non-finite"
            diff = ref.calc_diff(values, expected)
            assert diff < 1e-3, f"{where}: {name} differs from the reference (calc_diff {diff:.2e})"
        if first is None:
            first_name, first = name, got
        else:
            mismatched = int((got != first).sum())
            assert mismatched == 0, f"{where}: {name} differs from {first_name} in {mismatched} values"
