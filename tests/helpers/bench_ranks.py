"""Rank functions for the benchmark tests: the GPU parts of a benchmark (CuPy, the layer, the
timer) replaced by stand-ins, its cross-rank calls real (module level: spawn pickles them by name)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

# What this rank did that every rank must do alike, in order: collectives and layer lifetimes.
LOG: list[tuple] = []


class _Recording:
    """A rank context whose collectives are logged, then done."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device

    def broadcast(self, value: bytes | None, *, key: str = "default", root: int = 0) -> bytes:
        LOG.append(("broadcast", key, root))
        return self.ctx.broadcast(value, key=key, root=root)

    def barrier(self) -> None:
        LOG.append(("barrier",))
        self.ctx.barrier()

    def allgather(self, value: bytes, *, key: str = "default") -> list[bytes]:
        LOG.append(("allgather", key))
        return self.ctx.allgather(value, key=key)


class _Stream:
    def __init__(self, non_blocking: bool = False):
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Layer:
    """Pool blocks: the worst case of all ranks' tokens (128-row blocks), or a share of it."""

    def __init__(self, hidden, intermediate, experts, topk, tokens, *, mode, group, chunk_ratio=None):
        LOG.append(("layer", mode, chunk_ratio, experts, tokens))
        full = group.world_size * tokens * topk // 128
        blocks = full if chunk_ratio is None and mode != "fused" else max(1, int(full * (chunk_ratio or 0.1)))
        region = SimpleNamespace(nbytes=blocks * 128 * hidden)
        self.layout = SimpleNamespace(
            pool_blocks=blocks, region=lambda name: region, total_bytes=4 * region.nbytes + topk * tokens * hidden * 2
        )

    def load_weights(self, *weights: Any, stream: Any = None) -> None:
        pass

    def close(self) -> None:
        LOG.append(("close",))


def prefill_rank(ctx: Any, out_dir: str) -> tuple[list[dict], list[tuple]]:
    """``bench_prefill`` across the spawned ranks with stand-ins: rank r's time of ring q is
    ``1000 + 100 r`` at the full pool and ``1000 + 300 q - 50 r`` below it."""
    import megamoe_rt.cli.bench_prefill as bp
    import megamoe_rt.layer
    from megamoe_rt.cli.timing import ArmResult

    def bracketed(timer: Any, arms: dict, rounds: int = 3) -> dict[str, ArmResult]:
        out = {}
        for key in arms:
            us = 1000.0 + 100 * ctx.rank if key == str(bp.FULL) else 1000.0 + 300 * len(out) - 50 * ctx.rank
            out[key] = ArmResult(key, us, (us - 5, us + 5), [us] * rounds)
        return out

    sys.modules["cupy"] = SimpleNamespace(  # type: ignore[assignment]
        cuda=SimpleNamespace(Stream=_Stream),
        uint16="uint16",
        empty=lambda shape, dtype: None,
        get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
    )
    megamoe_rt.layer.MegaMoE = _Layer  # type: ignore[misc]
    bp.rank_inputs = lambda cp, rank, *a: ((None,) * 4, (None,) * 4)
    bp.DeviceTimer = lambda **kw: None
    bp.bracketed = bracketed
    bp.capture_layer_call = lambda layer, args, y, stream, **kw: SimpleNamespace(launch=lambda stream=None: None)
    rows = bp.bench_prefill(
        ["flash"],
        [1024, 2048],
        modes=["unfused", "fused"],
        ratios=[0.5, 0.25],
        group=_Recording(ctx),
        json_path=f"{out_dir}/rank{ctx.rank}.json",
        png_path=f"{out_dir}/rank{ctx.rank}.png",
    )
    return rows, LOG
