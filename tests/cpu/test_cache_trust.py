"""The cubin cache trusts only what only this user can write (cubins are executed)."""

from __future__ import annotations

import errno
import os
import warnings

import pytest

from megamoe_rt.jit import CubinCache, compile_kernel
from megamoe_rt.jit import cache as cache_mod
from megamoe_rt.jit import compiler as jit_compiler
from tests.helpers.toy_kernel import TOY


@pytest.fixture()
def private_tmp(tmp_path, monkeypatch):
    """The fallback directory lives under this test's own temp dir."""
    base = tmp_path / "systmp"
    base.mkdir()
    monkeypatch.setattr(cache_mod.tempfile, "gettempdir", lambda: str(base))
    return base


def test_a_group_writable_directory_is_refused_with_a_private_fallback(toy_kernel_tree, tmp_path, private_tmp):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    cache = CubinCache(shared)
    with pytest.warns(cache_mod.UntrustedCacheWarning, match="writable by group or others"):
        built = compile_kernel(TOY, cache=cache)
    assert not any(shared.iterdir())  # nothing written where others could have planted it
    assert cache.directory.parent == private_tmp and cache.directory.stat().st_mode & 0o777 == 0o700
    assert compile_kernel(TOY, cache=cache).from_cache and not built.from_cache


def test_a_directory_owned_by_another_user_is_refused(toy_kernel_tree, tmp_path, private_tmp, monkeypatch):
    mine = tmp_path / "theirs"
    mine.mkdir(mode=0o700)
    other = os.getuid() + 1
    from megamoe_rt.runtime import file_trust

    monkeypatch.setattr(file_trust, "current_uid", lambda: other)  # as seen by a different user
    cache = CubinCache(mine)
    with pytest.warns(cache_mod.UntrustedCacheWarning, match="owned by uid"):
        cache.store("k" * 40, b"\x00" * 8, {"lowered_name": "x"})
    assert cache.directory != mine and not any(mine.iterdir())


def test_a_symlinked_entry_is_never_loaded(toy_kernel_tree, tmp_path):
    cache = CubinCache(tmp_path / "c")
    good = compile_kernel(TOY, cache=cache)
    path = cache.path_for(good.cache_key)
    planted = tmp_path / "planted.cubin"
    planted.write_bytes(path.read_bytes())  # a valid entry, but reached through a link
    path.unlink()
    path.symlink_to(planted)
    assert cache.load(good.cache_key) is None and not path.exists() and cache.rejected == 1
    again = compile_kernel(TOY, cache=cache)
    assert not again.from_cache and again.cubin == good.cubin


def test_an_entry_others_can_write_is_never_loaded(toy_kernel_tree, tmp_path):
    cache = CubinCache(tmp_path / "c")
    good = compile_kernel(TOY, cache=cache)
    os.chmod(cache.path_for(good.cache_key), 0o666)
    assert cache.load(good.cache_key) is None and cache.rejected == 1
    assert not compile_kernel(TOY, cache=cache).from_cache


def test_an_entry_of_another_layout_is_rebuilt_not_a_type_error(toy_kernel_tree, tmp_path):
    cache = CubinCache(tmp_path / "c")
    good = compile_kernel(TOY, cache=cache)
    # Verifies (digest and key match) but carries metadata this version does not understand.
    cache.store(good.cache_key, good.cubin, {"lowered_name": 7, "resources": {"registers": "many"}})
    again = compile_kernel(TOY, cache=cache)
    assert not again.from_cache and cache.rejected == 1
    cache.store(good.cache_key, good.cubin, {"lowered_name": good.lowered_name})  # no resources at all
    assert not compile_kernel(TOY, cache=cache).from_cache and cache.rejected == 2
    assert compile_kernel(TOY, cache=cache).from_cache


def test_the_key_follows_the_package_version(toy_kernel_tree, tmp_path, monkeypatch):
    cache = CubinCache(tmp_path / "c")
    a = compile_kernel(TOY, cache=cache)
    monkeypatch.setattr(jit_compiler, "__version__", "0.0.0+other")
    b = compile_kernel(TOY, cache=cache)
    assert a.cache_key != b.cache_key and not b.from_cache


def test_clear_leaves_other_processes_temporary_files(toy_kernel_tree, tmp_path):
    cache = CubinCache(tmp_path / "c")
    compile_kernel(TOY, cache=cache)
    writing = cache.directory / ".tmp-inflight.cubin"  # another process, between write and rename
    writing.write_bytes(b"partial")
    assert cache.entries() == [cache.path_for(compile_kernel(TOY, cache=cache).cache_key)]
    assert cache.clear() == 1
    assert writing.exists() and cache.entries() == []


# The cache degrades, never fails: each trouble below gives one warning and the cubin just built.


@pytest.mark.parametrize("error", [errno.EACCES, errno.EROFS])
def test_an_unwritable_directory_builds_from_memory_with_one_warning(toy_kernel_tree, tmp_path, monkeypatch, error):
    cache = CubinCache(tmp_path / "c")
    first = compile_kernel(TOY, cache=cache)  # the directory exists and holds one entry

    def refuse(*args, **kwargs):  # what mkstemp meets in a read-only directory (root ignores modes)
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(cache_mod.tempfile, "mkstemp", refuse)
    cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = compile_kernel(TOY, cache=cache)
        again = compile_kernel(TOY, cache=cache)
    assert built.cubin == first.cubin and not built.from_cache and not again.from_cache
    assert [w.category for w in caught] == [cache_mod.CacheWriteWarning]
    assert "not writable" in str(caught[0].message)


def test_a_full_disk_leaves_no_partial_entry(toy_kernel_tree, tmp_path, monkeypatch):
    cache = CubinCache(tmp_path / "c")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_mod.os, "fsync", full)
    with pytest.warns(cache_mod.CacheWriteWarning, match="No space left"):
        built = compile_kernel(TOY, cache=cache)
    assert built.cubin and list(cache.directory.iterdir()) == [
        p for p in cache.directory.iterdir() if p.name.startswith(".lock-")
    ]


def test_a_fifo_at_an_entry_path_neither_hangs_nor_loads(toy_kernel_tree, tmp_path):
    cache = CubinCache(tmp_path / "c")
    good = compile_kernel(TOY, cache=cache)
    path = cache.path_for(good.cache_key)
    path.unlink()
    os.mkfifo(path, 0o600)
    assert cache.load(good.cache_key) is None  # opened without blocking, refused as not a regular file
    again = compile_kernel(TOY, cache=cache)
    assert again.cubin == good.cubin and not again.from_cache
    assert compile_kernel(TOY, cache=cache).from_cache  # the FIFO was replaced by a real entry


def test_a_directory_at_an_entry_path_is_ignored_with_one_warning(toy_kernel_tree, tmp_path):
    cache = CubinCache(tmp_path / "c")
    good = compile_kernel(TOY, cache=cache)
    path = cache.path_for(good.cache_key)
    path.unlink()
    path.mkdir()
    (path / "x").write_text("keeps the directory from being replaced")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            again = compile_kernel(TOY, cache=cache)
            assert again.cubin == good.cubin and not again.from_cache
    kinds = sorted({str(w.message).split(" (")[0] for w in caught})
    assert all(w.category is cache_mod.CacheWriteWarning for w in caught) and len(caught) == 2, kinds


def test_a_directory_that_cannot_be_created_falls_back(toy_kernel_tree, tmp_path, private_tmp):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache's parent directory should be")
    cache = CubinCache(blocker / "cache")
    with pytest.warns(cache_mod.UntrustedCacheWarning, match="cannot be created"):
        compile_kernel(TOY, cache=cache)
    assert cache.directory.parent == private_tmp and compile_kernel(TOY, cache=cache).from_cache


def test_the_split_tuning_file_passes_the_same_trust_checks(tmp_path):
    from megamoe_rt.graph import split_tuning
    from megamoe_rt.schedule.split_sms import SplitSms

    key = split_tuning.shape_key("H200", 132, 4096, 2048, 32, 6, 1)
    split_tuning.store(key, 2048, SplitSms(88, 44, 132), 900.0, cache_dir=tmp_path)
    assert split_tuning.lookup(key, 2048, cache_dir=tmp_path) == SplitSms(88, 44, 132)
    path = split_tuning.tuning_path(tmp_path)
    os.chmod(path, 0o666)  # others could have planted the splits
    with pytest.warns(UserWarning, match="writable by group or others"):
        assert split_tuning.lookup(key, 2048, cache_dir=tmp_path) is None
    path.unlink()
    os.mkfifo(path, 0o600)
    with pytest.warns(UserWarning, match="not a regular file"):
        assert split_tuning.lookup(key, 2048, cache_dir=tmp_path) is None


def test_a_full_disk_warns_once_however_many_kernels_are_built(toy_kernel_tree, tmp_path, monkeypatch):
    # Every build opens the cache afresh (compile_kernel without cache=): the warning is per
    # directory and process, not per kernel, so a layer's first call prints one line.
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_mod.os, "fsync", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cache = CubinCache(tmp_path / "c")
            cache.clear()
            assert compile_kernel(TOY, cache=cache).cubin
    assert [w.category for w in caught] == [cache_mod.CacheWriteWarning], [str(w.message) for w in caught]
