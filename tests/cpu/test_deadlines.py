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


def test_timeouts_are_clamped_to_what_the_device_can_count():
    from megamoe_rt.runtime.deadlines import MAX_TIMEOUT_NS, MIN_TIMEOUT_NS

    assert wait_timeout_ns(1e-10) == MIN_TIMEOUT_NS  # was 0 ns: every wait would trap at once
    assert wait_timeout_ns(1e30) == MAX_TIMEOUT_NS  # was past 2^64 ns
    assert wait_timeout_ns(1e-3) == MIN_TIMEOUT_NS and wait_timeout_ns(7) == 7 * 10**9
    assert MAX_TIMEOUT_NS << 5 < 2**64  # the longest scaled deadline still fits
    for bad in (True, "5", None.__class__):
        with pytest.raises(TypeError, match="timeout_s"):
            wait_timeout_ns(bad)
