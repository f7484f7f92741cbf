"""Processes that need the same missing cubin build it once (CubinCache.building)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from megamoe_rt.jit import CubinCache, compile_kernel
from megamoe_rt.jit import compiler as jit_compiler
from tests.helpers.toy_kernel import TOY

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="advisory file locks are POSIX")


def test_two_builders_of_one_entry_compile_it_once(toy_kernel_tree, tmp_path, monkeypatch):
    real = jit_compiler._nvrtc_compile
    compiles = []

    def slow_compile(spec, options):
        compiles.append(spec.name)
        time.sleep(0.5)  # the second builder arrives while the first is compiling
        return real(spec, options)

    monkeypatch.setattr(jit_compiler, "_nvrtc_compile", slow_compile)
    results = [None, None]

    def build(i):
        # One CubinCache each, as two processes would have; flock locks of separate opens conflict.
        results[i] = compile_kernel(TOY, cache=CubinCache(tmp_path / "cache"))

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=120)
    assert compiles == [TOY.name]
    assert sorted(r.from_cache for r in results) == [False, True]
    assert results[0].cubin == results[1].cubin and results[0].resources == results[1].resources


def _hold_lock_in_child(directory, key, seconds):
    code = (
        "import sys, time\n"
        "from megamoe_rt.jit import CubinCache\n"
        f"with CubinCache({str(directory)!r}).building({key!r}) as held:\n"
        "    print('held' if held else 'not held', flush=True)\n"
        f"    time.sleep({seconds})\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_build_held_by_another_process_is_waited_for_until_the_deadline(tmp_path):
    directory = tmp_path / "cache"
    child = _hold_lock_in_child(directory, "k1", 30)
    try:
        t0 = time.monotonic()
        with CubinCache(directory).building("k1", wait_s=0.3) as held:
            assert not held  # the holder did not let go: build unlocked, never hang
        assert 0.25 <= time.monotonic() - t0 < 10
        with CubinCache(directory).building("k2", wait_s=0.3) as held:
            assert held  # another entry's lock is independent
    finally:
        child.kill()
        child.wait()
    with CubinCache(directory).building("k1", wait_s=5) as held:
        assert held  # released when its holder exits


def test_a_link_planted_as_the_lock_file_is_not_followed(tmp_path):
    directory = tmp_path / "cache"
    cache = CubinCache(directory)
    cache._ensure_dir()
    target = tmp_path / "victim"
    target.write_text("untouched")
    os.symlink(target, directory / ".lock-k")
    with cache.building("k") as held:
        assert not held
    assert target.read_text() == "untouched"


def test_lock_files_are_not_entries(tmp_path):
    cache = CubinCache(tmp_path / "cache")
    with cache.building("k") as held:
        assert held
        cache.store("k", b"\x7fELF", {"name": "x"})
    assert [p.name for p in cache.entries()] == ["k.cubin"]
    assert cache.clear() == 1


def test_a_file_system_without_locks_builds_unlocked(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with CubinCache(tmp_path / "cache").building("k") as held:
        assert not held
