"""NvshmemRuntime.barrier orders barriers across streams (two barriers of one team running at
once deadlock NVSHMEM), checked on the CPU with the driver and NVSHMEM stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megamoe_rt.ep import symm


class _Log:
    def __init__(self):
        self.ops: list[tuple] = []
        self.capturing: set[int] = set()


@pytest.fixture
def runtime(monkeypatch):
    log = _Log()

    class Event:
        made = 0

        def __init__(self, *, device=None, timing=True):
            Event.made += 1
            self.id = Event.made
            log.ops.append(("event", self.id))

        def record(self, stream=None):
            log.ops.append(("record", self.id, stream))
            return self

        def wait_on(self, stream=None):
            log.ops.append(("wait", self.id, stream))

        def close(self):
            log.ops.append(("close", self.id))

    fake_streams = SimpleNamespace(
        stream_handle=lambda s: int(s),
        stream_is_capturing=lambda s: s in log.capturing,
        core_stream=lambda s: ("core", s),
        Event=Event,
    )
    monkeypatch.setattr(symm, "streams", fake_streams)
    nvshmem = SimpleNamespace(
        Teams=SimpleNamespace(TEAM_WORLD="world"),
        barrier=lambda team, stream: log.ops.append(("barrier", team, stream[1])),
        finalize=lambda: log.ops.append(("finalize",)),
    )
    rt = object.__new__(symm.NvshmemRuntime)
    rt._nvshmem, rt._buffers, rt._last_barrier, rt.device = nvshmem, [], None, 0
    rt._device_libraries, rt.shares_gpu = [], False
    rt.ctx = SimpleNamespace(peer_failure=lambda: None)  # a group whose heartbeats found no failure
    return rt, log


def test_ranks_sharing_a_gpu_get_an_error_not_nvshmems_abort(runtime):
    rt, log = runtime
    rt.shares_gpu = True
    with pytest.raises(RuntimeError, match="ranks share a GPU"):
        rt.barrier(11)
    assert log.ops == []


def test_each_barrier_waits_for_the_previous_one_whatever_its_stream(runtime):
    rt, log = runtime
    for stream in (11, 22, 22, 33):
        rt.barrier(stream)
    assert log.ops == [
        ("barrier", "world", 11),
        ("event", 1),
        ("record", 1, 11),
        ("wait", 1, 22),
        ("barrier", "world", 22),
        ("record", 1, 22),
        ("wait", 1, 22),
        ("barrier", "world", 22),
        ("record", 1, 22),
        ("wait", 1, 33),
        ("barrier", "world", 33),
        ("record", 1, 33),
    ]


def test_a_captured_barrier_neither_waits_on_nor_records_uncaptured_work(runtime):
    rt, log = runtime
    rt.barrier(11)
    log.capturing.add(22)
    log.ops.clear()
    rt.barrier(22)
    assert log.ops == [("barrier", "world", 22)]


def test_finalize_closes_the_barrier_event(runtime, monkeypatch):
    rt, log = runtime
    monkeypatch.setattr(symm.NvshmemRuntime, "_active", rt)
    rt.barrier(11)
    rt.finalize()
    assert log.ops[-2:] == [("close", 1), ("finalize",)]
    assert rt._last_barrier is None and symm.NvshmemRuntime._active is None


def test_finalize_takes_back_the_device_state_of_loaded_libraries_first(runtime, monkeypatch):
    import sys

    rt, log = runtime
    bindings = SimpleNamespace(
        culibrary_init=lambda lib: log.ops.append(("culibrary_init", lib)) or 0,
        culibrary_finalize=lambda lib: log.ops.append(("culibrary_finalize", lib)) or 0,
    )
    monkeypatch.setitem(sys.modules, "nvshmem", SimpleNamespace(bindings=bindings))
    monkeypatch.setitem(sys.modules, "nvshmem.bindings", bindings)
    monkeypatch.setattr(symm.NvshmemRuntime, "_active", rt)
    rt.init_device_library(0xAB, "k1", lambda: log.ops.append(("forget", "k1")))
    rt.init_device_library(0xCD, "k2", lambda: log.ops.append(("forget", "k2")))
    rt.finalize()
    assert log.ops == [
        ("culibrary_init", 0xAB),
        ("culibrary_init", 0xCD),
        ("culibrary_finalize", 0xAB),
        ("forget", "k1"),
        ("culibrary_finalize", 0xCD),
        ("forget", "k2"),
        ("finalize",),
    ]
    assert rt._device_libraries == []


def test_a_device_api_kernel_needs_nvshmem_running_on_its_gpu(monkeypatch):
    monkeypatch.setattr(symm.NvshmemRuntime, "_active", None)
    with pytest.raises(RuntimeError, match="kernel probe calls NVSHMEM's device API: initialise NVSHMEM"):
        symm.NvshmemRuntime.require_device_api("probe", 0)
    rt = object.__new__(symm.NvshmemRuntime)
    rt.device = 1
    monkeypatch.setattr(symm.NvshmemRuntime, "_active", rt)
    with pytest.raises(RuntimeError, match="kernel probe is loaded on GPU 0, but NVSHMEM runs this process on GPU 1"):
        symm.NvshmemRuntime.require_device_api("probe", 0)
    rt.device = 0
    assert symm.NvshmemRuntime.require_device_api("probe", 0) is rt


def test_a_barrier_is_not_enqueued_once_a_peer_is_known_to_have_failed(runtime):
    rt, log = runtime
    rt.ctx = SimpleNamespace(peer_failure=lambda: RuntimeError("rank 1 failed: its process died"))
    with pytest.raises(RuntimeError, match="not entered, a peer failed: rank 1 failed"):
        rt.barrier(stream=7)
    assert not any(op[0] == "barrier" for op in log.ops), log.ops
