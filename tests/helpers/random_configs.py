"""Random layer configurations for the GPU tests: a shape, requant options and a routing,
all drawn from one seed, so a failure names the seed that replays it."""

from __future__ import annotations

import numpy as np

from megamoe_rt import reference as ref

# Keeps the reference forward (numpy, on the host) to a few seconds per configuration.
REFERENCE_MACS = 2e10


def draw_config(rng: np.random.Generator, num_ranks: int = 1) -> dict:
    """Shape, options and routing style. ``tokens`` is one count per rank; ``capacity`` is at
    least the largest of them."""
    hidden = 128 * int(rng.choice([1, 2, 3, 4, 5, 8, 12, 16, 56]))
    intermediate = 128 * int(rng.choice([1, 2, 3, 4, 6, 8, 16]))
    per_rank = [1, 2, 3, 5, 8, 13, 16, 32, 48, 64, 128, 256] if num_ranks == 1 else [1, 2, 3, 5, 8, 16, 32]
    experts = num_ranks * int(rng.choice(per_rank))
    topk = int(rng.integers(1, min(experts, 9) + 1))
    if experts >= 32 and rng.random() < 0.15:
        topk = 32  # the slot mask's full width
    most = max(1, int(REFERENCE_MACS // (3 * hidden * intermediate * topk)))
    tokens = [
        min(most, int(rng.choice([0, 1, 2, int(rng.integers(3, 300)), int(rng.integers(300, 2500))])))
        for _ in range(num_ranks)
    ]
    capacity = max(1, max(tokens) + int(rng.choice([0, 0, 1, int(rng.integers(1, 700))])))
    return {
        "shape": (hidden, intermediate, experts, topk),
        "tokens": tokens,
        "capacity": capacity,
        "limit": None if rng.random() < 0.5 else float(rng.uniform(0.2, 4.0)),
        "gran": int(rng.choice([64, 128])),
        "pow2": bool(rng.random() < 0.3),
        "empty": float(rng.choice([0.0, 0.05, 0.3])),
        "hot": bool(rng.random() < 0.3),
        "int64": bool(rng.random() < 0.3),
    }


def routed_inputs(rng: np.random.Generator, cfg: dict, tokens: int) -> dict:
    """``reference.random_moe_inputs`` for ``tokens`` tokens, routed as ``cfg`` says: with
    ``hot``, most tokens go to the same top-k experts (ids 0..k-1, all on the first rank)."""
    hidden, intermediate, experts, topk = cfg["shape"]
    inp = ref.random_moe_inputs(rng, tokens, hidden, intermediate, experts, topk, empty_slot_prob=cfg["empty"])
    idx = inp["topk_idx"]
    if cfg["hot"] and tokens:
        hot = rng.random(tokens) < 0.8
        idx[hot] = rng.permutation(topk).astype(idx.dtype)
        idx[rng.random(idx.shape) < cfg["empty"]] = -1
    if cfg["int64"]:
        inp["topk_idx"] = idx.astype(np.int64)
    return inp


def reference_output(inp: dict, cfg: dict, rows: slice = slice(None)) -> np.ndarray:
    """The reference forward of ``inp``'s tokens ``rows`` (float32)."""
    return ref.moe_forward(
        inp["x"][rows],
        inp["x_sf"][rows],
        inp["topk_idx"][rows],
        inp["topk_weights"][rows],
        inp["w1"],
        inp["w1_sf"],
        inp["w2"],
        inp["w2_sf"],
        swiglu_limit=cfg["limit"],
        act_sf_gran=cfg["gran"],
        pow2_scale=cfg["pow2"],
    ).astype(np.float32)


def layer_options(cfg: dict) -> dict:
    """The MegaMoE keyword arguments of the configuration's requant options."""
    return {"swiglu_limit": cfg["limit"], "act_sf_gran": cfg["gran"], "pow2_scale": cfg["pow2"]}


SMALLEST_RING = 1e-9  # a chunk_ratio below every mode's minimum: the smallest ring the mode takes


def smallest_ring_arms(hidden: int) -> list[tuple[str, dict]]:
    """(name, MegaMoE keyword arguments) of every batch mode that runs ``hidden``, each with the
    full pool and with its smallest ring (split: the full pool only)."""
    arms = [("unfused", {"mode": "unfused"}), ("unfused ring", {"mode": "unfused", "chunk_ratio": SMALLEST_RING})]
    if hidden % 256 == 0:
        arms += [
            ("fused", {"mode": "fused"}),
            ("fused ring", {"mode": "fused", "chunk_ratio": SMALLEST_RING}),
            ("split", {"mode": "split"}),
        ]
    return arms


def random_seeds() -> list[int]:
    """``$MEGAMOE_RT_RANDOM_SEED`` alone, else ``$MEGAMOE_RT_RANDOM_CONFIGS`` (default 3) new ones."""
    import os
    import secrets

    fixed = os.environ.get("MEGAMOE_RT_RANDOM_SEED")
    if fixed:
        return [int(fixed)]
    return [secrets.randbits(32) for _ in range(int(os.environ.get("MEGAMOE_RT_RANDOM_CONFIGS", "3")))]
