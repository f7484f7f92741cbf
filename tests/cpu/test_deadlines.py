"""Deadlines of device-side waits: the host setting (CPU) and a withheld signal (GPU)."""

from __future__ import annotations

from pathlib import Path

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


def test_every_mbarrier_wait_in_the_kernels_has_a_deadline():
    # The waiting loops are sync/mbarrier_deadline.cuh's and one without a deadline in ptx/,
    # used only by the math warpgroups where another wait bounds it (each use says which): the
    # wait for a loaded stage and for the tile announced in it (the producer's waits and drain),
    # for a tile ticket (the producer's) and for a relay slot (the relay thread, which waits on
    # nothing else).
    root = Path(__file__).resolve().parents[2] / "cuda_src"
    sources = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*.cu*")}
    loops = sorted(name for name, text in sources.items() if "mbarrier.try_wait" in text)
    assert loops == ["ptx/mbarrier.cuh", "sync/mbarrier_deadline.cuh"], loops
    unbounded = "mbarrier_wait_parity_shared_bounded_elsewhere("
    users = {name: text.count(unbounded) for name, text in sources.items() if unbounded in text}
    assert users == {
        "ptx/mbarrier.cuh": 1,
        "gemm/mainloop.cuh": 1,
        "gemm/tile_slots.cuh": 1,
        "fused/tile_queue.cuh": 1,
        "fused/signal_relay.cuh": 1,
    }, users
    mainloop = sources["gemm/mainloop.cuh"]
    assert "drain_stages" in sources["gemm/sm90_fp8_grouped_gemm.cu"]
    # The end marker's stage is released too, so the drain after it completes.
    assert (
        "release_end" in sources["gemm/sm90_fp8_grouped_gemm.cu"]
        and "announce_end" in sources["gemm/sm90_fp8_grouped_gemm.cu"]
    )
    assert "drain_stages" in sources["fused/sm90_fp8_fused_moe.cu"]
    assert "void drain_stages" in mainloop


def _completed_record(site: str, **fields):
    """A complete TimeoutRecord of wait site ``site`` with ``fields`` (block, thread, rank, peer,
    expected, seen, elapsed_ns), as a trapped wait leaves it."""
    from megamoe_rt.kernels.interface import sync as decl
    from megamoe_rt.kernels.interface.structs import TimeoutRecord as Fields

    return Fields(state=decl.RECORD_COMPLETE.value, site=decl.WAIT_SITE[site], **fields)


def test_a_timed_out_mbarrier_wait_is_described_by_its_slot_and_phase():
    from megamoe_rt.runtime.deadlines import describe

    rec = _completed_record(
        "kSmemStageFree", block=7, thread=128, rank=1, peer=3, expected=1, seen=0, elapsed_ns=3 << 32
    )
    text = describe(rec)
    assert text.startswith("megamoe_rt: wait 'shared-memory stage released' timed out after 12.9 s"), text
    assert "block 7 thread 128, rank 1: phase 1 of slot 3 never completed" in text, text


def test_a_streamed_ready_list_timeout_names_the_position_and_the_blocks_completed():
    from megamoe_rt.runtime.deadlines import describe

    rec = _completed_record(
        "kStreamBlockReady", block=2, thread=0, rank=0, peer=5, expected=6, seen=4, elapsed_ns=300_000_000
    )
    text = describe(rec)
    assert text.startswith("megamoe_rt: wait 'stream block ready' timed out after 0.30 s on rank 0"), text
    assert "ready-list position 5 never filled (4 blocks had completed)" in text, text
