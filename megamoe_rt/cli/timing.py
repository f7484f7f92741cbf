"""Benchmark timing: CUDA-event device time, L2 flushed and a short sleep before
each call, 20 calls per observation, several observations, arms bracketed in rounds
(A B, B A, A B); the result is the median of round medians with the min-max band. Across
launched ranks every rank measures and the ranks exchange their numbers (:func:`every_rank`)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megamoe_rt.ep.group import RankGroup

FP8_CEILING_TFLOPS = 1400.0
HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the lent H200
L2_FLUSH_BYTES = 256 * 2**20  # > 4x the H200's 60 MB L2


@dataclass
class ArmResult:
    name: str
    median_us: float
    band_us: tuple[float, float]
    rounds_us: list[float] = field(default_factory=list)
    error: str | None = None


class DeviceTimer:
    def __init__(self, *, calls: int = 20, observations: int = 3, sleep_s: float = 0.0005):
        import cupy as cp

        self.cp = cp
        self.calls = calls
        self.observations = observations
        self.sleep_s = sleep_s
        self.scratch = cp.empty(L2_FLUSH_BYTES, dtype=cp.uint8)

    def observe(self, fn: Callable[[], None]) -> float:
        """Median device time (µs) over `calls` calls, each after a short sleep and an L2 flush.

        The flush is queued after the sleep and not waited for: while the GPU runs it,
        the host queues the start event and the call, so launch overhead stays out of
        the measured interval.
        """
        cp = self.cp
        times = []
        for _ in range(self.calls):
            cp.cuda.get_current_stream().synchronize()
            time.sleep(self.sleep_s)
            self.scratch.fill(0x5A)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        return statistics.median(times)

    def arm_round(self, fn: Callable[[], None]) -> float:
        return statistics.median(self.observe(fn) for _ in range(self.observations))


def bracketed(timer: DeviceTimer, arms: dict[str, Callable[[], None]], rounds: int = 3) -> dict[str, ArmResult]:
    """Run arms in rounds, alternating their order, so drift hits every arm alike."""
    names = list(arms)
    per: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    for fn_name in names:  # warm-up: JIT, module load, allocator
        try:
            arms[fn_name]()
        except Exception as exc:  # a peer arm that cannot run is reported, not fatal
            errors[fn_name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    timer.cp.cuda.get_current_stream().synchronize()
    live = [n for n in names if n not in errors]
    for r in range(rounds):
        order = live if r % 2 == 0 else list(reversed(live))
        for n in order:
            per[n].append(timer.arm_round(arms[n]))
    out = {}
    for n in names:
        if n in errors:
            out[n] = ArmResult(n, float("nan"), (float("nan"), float("nan")), [], errors[n])
        else:
            out[n] = ArmResult(n, statistics.median(per[n]), (min(per[n]), max(per[n])), per[n])
    return out


def capture_layer_call(layer, args, out, stream, **kwargs):
    """One eager call (kernels load, plans build), then the same call captured in a CUDA graph."""
    with stream:
        layer(*args, out=out, stream=stream, **kwargs)
        stream.synchronize()
        stream.begin_capture()
        layer(*args, out=out, stream=stream, **kwargs)
        return stream.end_capture()


def arm_times(res: ArmResult) -> dict[str, Any]:
    """One arm's times as JSON, the form the ranks exchange (:func:`every_rank`)."""
    return {"median_us": res.median_us, "band_us": list(res.band_us), "rounds_us": res.rounds_us, "error": res.error}


def slowest_rank(everyone: list[dict[str, dict]], key: str) -> dict:
    """Arm ``key``'s times (:func:`arm_times`) of the slowest rank, from every rank's times by
    arm: a call across ranks ends with its slowest rank. A rank whose arm failed counts as the
    slowest, so its error is what the row reports."""
    return max((e[key] for e in everyone), key=lambda r: (r.get("error") is not None, r["median_us"]))


def every_rank(group: RankGroup | None, mine: Any, key: str) -> list[Any]:
    """Every rank's ``mine`` (JSON-able) in rank order, ``[mine]`` without a group: one broadcast
    per rank, the same calls in the same order on every rank (through the launcher's hub, so
    a long result is not held to the size of an all-gather slot)."""
    if group is None:
        return [mine]
    return [
        json.loads(group.broadcast(json.dumps(mine).encode() if group.rank == r else None, key=key, root=r))
        for r in range(group.world_size)
    ]
