"""Deadlines of device-side spin-waits (cuda_src/sync/deadline_wait.cuh)."""

from __future__ import annotations

import math
import os

DEFAULT_TIMEOUT_S = 60.0
ENV = "MEGAMOE_RT_TIMEOUT_S"


def wait_timeout_ns(timeout_s: float | None = None) -> int:
    """The deadline every cross-rank or cross-block wait of a launch gets, in nanoseconds.

    ``timeout_s`` wins; else ``$MEGAMOE_RT_TIMEOUT_S``; else 60 s.
    """
    if timeout_s is None:
        raw = os.environ.get(ENV)
        if raw is None or raw.strip() == "":
            timeout_s = DEFAULT_TIMEOUT_S
        else:
            try:
                timeout_s = float(raw)
            except ValueError:
                raise ValueError(f"{ENV}={raw!r}: expected a number of seconds") from None
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout_s!r}")
    return int(timeout_s * 1e9)
