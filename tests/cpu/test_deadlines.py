"""Deadlines of device-side waits: the host setting (CPU) and a withheld signal (GPU)."""

from __future__ import annotations

import pytest

from megamoe_rt.runtime.deadlines import wait_timeout_ns


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("MEGAMOE_RT_TIMEOUT_S", raising=False)
    assert wait_timeout_ns() == 60 * 10**9
    monkeypatch.setenv("MEGAMOE_RT_TIMEOUT_S", "0.25")
    assert wait_timeout_ns() == 250_000_000
    assert wait_timeout_ns(2) == 2 * 10**9
    monkeypatch.setenv("MEGAMOE_RT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MEGAMOE_RT_TIMEOUT_S='soon'"):
        wait_timeout_ns()
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            wait_timeout_ns(bad)
