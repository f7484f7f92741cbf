"""Random layer configurations through every mode that runs them (needs a Hopper GPU).

Each configuration draws a shape (hidden, intermediate, experts, top-k, tokens, capacity), the
requant options and a routing (uniform, skewed onto a few hot experts, empty slots, int32 or
int64 ids). Every mode that accepts the shape runs it: unfused and fused with the full pool
and with the smallest ring they take, split, and a streamed call. Each output must match the
reference forward, and all of them must be bit-identical.

The seed is new on every run and shown in a failure; ``MEGAMOE_RT_RANDOM_SEED`` replays one,
``MEGAMOE_RT_RANDOM_CONFIGS`` sets how many configurations a run draws (default 3).
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.layer_calls import BF16_NAN, bf16, device_args, run_poisoned

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

SMALLEST_RING = 1e-9  # a chunk_ratio below every mode's minimum: the smallest ring the mode takes


def _draw(rng: np.random.Generator) -> dict:
    hidden = 128 * int(rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 56]))
    intermediate = 128 * int(rng.choice([1, 2, 3, 4, 6, 8, 16]))
    experts = int(rng.choice([1, 2, 3, 5, 8, 13, 16, 32, 48, 64, 128, 256]))
    topk = int(rng.integers(1, min(experts, 9) + 1))
    if experts >= 32 and rng.random() < 0.15:
        topk = 32  # the slot mask's full width
    tokens = int(rng.choice([0, 1, 2, int(rng.integers(3, 300)), int(rng.integers(300, 2500))]))
    capacity = max(1, tokens + int(rng.choice([0, 0, 1, int(rng.integers(1, 700))])))
    return {
        "shape": (hidden, intermediate, experts, topk, tokens, capacity),
        "limit": None if rng.random() < 0.5 else float(rng.uniform(0.2, 4.0)),
        "gran": int(rng.choice([64, 128])),
        "pow2": bool(rng.random() < 0.3),
        "empty": float(rng.choice([0.0, 0.05, 0.3])),
        "hot": bool(rng.random() < 0.3),
        "int64": bool(rng.random() < 0.3),
    }


def _inputs(rng: np.random.Generator, cfg: dict) -> dict:
    hidden, intermediate, experts, topk, tokens, _ = cfg["shape"]
    inp = ref.random_moe_inputs(rng, tokens, hidden, intermediate, experts, topk, empty_slot_prob=cfg["empty"])
    idx = inp["topk_idx"]
    if cfg["hot"] and tokens:
        hot = rng.random(tokens) < 0.8
        idx[hot] = rng.permutation(topk).astype(idx.dtype)  # experts 0..topk-1 take most rows
        idx[rng.random(idx.shape) < cfg["empty"]] = -1
    if cfg["int64"]:
        inp["topk_idx"] = idx.astype(np.int64)
    return inp


def _arms(cfg: dict) -> list[tuple[str, dict]]:
    hidden, _, _, _, tokens, capacity = cfg["shape"]
    arms = [("unfused", {"mode": "unfused"}), ("unfused ring", {"mode": "unfused", "chunk_ratio": SMALLEST_RING})]
    if hidden % 256 == 0:
        arms += [
            ("fused", {"mode": "fused"}),
            ("fused ring", {"mode": "fused", "chunk_ratio": SMALLEST_RING}),
            ("split", {"mode": "split"}),
        ]
    if tokens:
        from megamoe_rt.streaming import StreamConfig

        per_slot = max(1, min(capacity, (tokens + 2) // 3))
        arms.append(("streamed", {"streaming": StreamConfig(1 + tokens % 3, per_slot)}))
    return arms


def _run_arm(kw: dict, cfg: dict, inp: dict, args: list) -> np.ndarray:
    from megamoe_rt import MegaMoE

    hidden, intermediate, experts, topk, tokens, capacity = cfg["shape"]
    layer = MegaMoE(
        hidden,
        intermediate,
        experts,
        topk,
        capacity,
        swiglu_limit=cfg["limit"],
        act_sf_gran=cfg["gran"],
        pow2_scale=cfg["pow2"],
        **kw,
    )
    try:
        layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
        if "streaming" not in kw:
            return run_poisoned(layer, args)
        from megamoe_rt.streaming import ChunkWriter

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


def _seeds() -> list[int]:
    fixed = os.environ.get("MEGAMOE_RT_RANDOM_SEED")
    if fixed:
        return [int(fixed)]
    return [secrets.randbits(32) for _ in range(int(os.environ.get("MEGAMOE_RT_RANDOM_CONFIGS", "3")))]


@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: f"seed{s}")
def test_a_random_configuration_gives_the_reference_in_every_mode_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    cfg = _draw(rng)
    inp = _inputs(rng, cfg)
    where = f"MEGAMOE_RT_RANDOM_SEED={seed}: {cfg}"
    expected = ref.moe_forward(
        inp["x"],
        inp["x_sf"],
        inp["topk_idx"],
        inp["topk_weights"],
        inp["w1"],
        inp["w1_sf"],
        inp["w2"],
        inp["w2_sf"],
        swiglu_limit=cfg["limit"],
        act_sf_gran=cfg["gran"],
        pow2_scale=cfg["pow2"],
    ).astype(np.float32)
    args = device_args(inp)
    first_name, first = None, None
    for name, kw in _arms(cfg):
        got = _run_arm(kw, cfg, inp, args)
        assert got.shape == expected.shape, f"{where}: {name} returned {got.shape}"
        if cfg["shape"][4]:
            values = bf16(got)
            assert np.isfinite(values).all(), f"{where}: {name} left rows unwritten or non-finite"
            diff = ref.calc_diff(values, expected)
            assert diff < 1e-3, f"{where}: {name} differs from the reference (calc_diff {diff:.2e})"
        if first is None:
            first_name, first = name, got
        else:
            mismatched = int((got != first).sum())
            assert mismatched == 0, f"{where}: {name} differs from {first_name} in {mismatched} values"
