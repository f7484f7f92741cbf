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

    def wait_event(self, event: Any) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Layer:
    """Pool blocks: the worst case of all ranks' tokens (128-row blocks), or a share of it."""

    def __init__(
        self, hidden, intermediate, experts, topk, tokens, *, group, mode=None, chunk_ratio=None, streaming=None
    ):
        self.mode = "streamed" if streaming is not None else mode
        LOG.append(("layer", self.mode, chunk_ratio, experts, tokens))
        full = group.world_size * tokens * topk // 128
        blocks = full if chunk_ratio is None and mode != "fused" else max(1, int(full * (chunk_ratio or 0.1)))
        region = SimpleNamespace(nbytes=blocks * 128 * hidden)
        self.layout = SimpleNamespace(
            pool_blocks=blocks, region=lambda name: region, total_bytes=4 * region.nbytes + topk * tokens * hidden * 2
        )

    def load_weights(self, *weights: Any, stream: Any = None) -> None:
        pass

    def __call__(self, x, x_sf, topk_idx, topk_weights, *, out=None, stream=None, num_tokens_bound=None) -> Any:
        LOG.append(("call", self.mode, num_tokens_bound))
        return out

    def consume(self, num_tokens: int, *, out=None, stream=None, num_tokens_bound=None) -> Any:
        LOG.append(("consume", num_tokens, num_tokens_bound))
        return out

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
    )
    return rows, LOG


class _Array:
    def __init__(self, shape: tuple = ()):
        self.shape = tuple(shape)

    def __matmul__(self, other: _Array) -> _Array:
        return _Array((self.shape[0], other.shape[1]))

    def __truediv__(self, value: float) -> _Array:
        return self


class _Router:
    """The producer: what it does relative to the layer's calls is logged (warm before any call waits)."""

    def __init__(self, num_experts: int, num_topk: int, layer: Any):
        LOG.append(("router", num_experts))
        self.num_topk = num_topk

    def warm(self, hidden: Any, gate: Any, stream: Any) -> None:
        LOG.append(("warm",))

    def route_batch(self, hidden: Any, gate: Any) -> tuple[Any, ...]:
        return hidden, None, None, None, hidden @ gate

    def produce(self, hidden: Any, gate: Any, stream: Any) -> list[Any]:
        LOG.append(("produce",))
        return [hidden @ gate]


# Rank r's times of the arms (sequential unfused, sequential fused, streamed): the slowest rank
# differs from arm to arm.
STREAM_US = {0: [1000.0, 900.0, 800.0], 1: [1100.0, 850.0, 750.0]}


def stream_rank(ctx: Any, out_dir: str, differ_rank: int | None) -> tuple[Any, list[tuple]]:
    """``bench_stream`` across the spawned ranks with stand-ins (``STREAM_US``; the streamed
    call differs from the batch call on ``differ_rank``), chunks of 768 tokens (cut to 512 in
    the 512-token cell). Returns the rows, or what it raised."""
    import megamoe_rt.cli.bench_stream as bs
    import megamoe_rt.layer
    import megamoe_rt.routers
    from megamoe_rt.cli.timing import ArmResult

    def bracketed(timer: Any, arms: dict, rounds: int = 3) -> dict[str, ArmResult]:
        out = {}
        for i, (key, arm) in enumerate(arms.items()):
            arm()  # its collectives, as the warm-up makes them
            us = STREAM_US[ctx.rank][i]
            out[key] = ArmResult(key, us, (us - 5, us + 5), [us] * rounds)
        return out

    sys.modules["cupy"] = SimpleNamespace(  # type: ignore[assignment]
        cuda=SimpleNamespace(
            Stream=_Stream,
            Event=lambda disable_timing=False: SimpleNamespace(record=lambda stream: None),
            get_current_stream=_Stream,
            Device=lambda: SimpleNamespace(synchronize=lambda: None),
        ),
        random=SimpleNamespace(
            RandomState=lambda seed: SimpleNamespace(standard_normal=lambda shape, dtype: _Array(shape))
        ),
        int32="int32",
        float32="float32",
        uint16="uint16",
        empty=lambda shape, dtype=None: _Array(shape),
        concatenate=lambda arrays: arrays[0],
        array_equal=lambda a, b: ctx.rank != differ_rank,
        get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
    )
    megamoe_rt.layer.MegaMoE = _Layer  # type: ignore[misc]
    megamoe_rt.routers.Router = _Router  # type: ignore[misc]
    bs.rank_inputs = lambda cp, rank, *a: ((None,) * 4, (None,) * 4)
    bs.DeviceTimer = lambda **kw: None  # type: ignore[assignment,misc]
    bs.bracketed = bracketed
    try:
        rows: Any = bs.bench_stream(
            ["flash"], [512, 1024], chunk=768, group=_Recording(ctx), json_path=f"{out_dir}/rank{ctx.rank}.json"
        )
    except AssertionError as exc:
        rows = f"raised: {exc}"
    return rows, LOG
