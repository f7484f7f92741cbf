"""On-disk cubin cache with verified entries.

Layout: ``$MEGAMOE_RT_CACHE`` (default ``~/.cache/megamoe_rt``, created 0700),
one file per key. An entry is ``MAGIC | u32 header length | JSON header | cubin |
SHA-256 of everything before it``; the header carries the key and the cubin's
length, and the trailing digest covers header and cubin alike. Entries are
written to a temporary file in the same directory and renamed into place, so a
reader sees either nothing or a whole file; a truncated or altered entry fails
verification, is removed and rebuilt, and is never loaded.

Processes that need the same missing entry at once (the ranks of one node starting together)
build it once: :meth:`CubinCache.building` holds an advisory lock on ``.lock-<key>`` while one
of them compiles, and the others find the entry when they get the lock. Besides saving the
repeated work, this avoids concurrent NVRTC builds of one kernel, where a process was seen to
get its cubin with an empty log, so without the ptxas report the resource checks read.

Cubins are executed, so the cache is trusted only as far as its files can be: a directory not
owned by the user, or writable by group or others, is refused with a warning and a private
directory is used instead; entries are opened without following links and must be regular
files owned by the user and writable by nobody else. The trailing digest catches damage, not
tampering: the trust comes from ownership and modes.

The cache degrades, it never fails a build: a directory that cannot be created, written or
trusted, a full disk, or an odd file at an entry's path (a FIFO, a directory) each give one
warning, and the cubin just compiled is used from memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megamoe_rt.runtime.file_trust import current_uid, read_trusted_file, untrusted_reason

MAGIC = b"MMRTCUBIN2\n"
_TMP_PREFIX = ".tmp-"
_LOCK_PREFIX = ".lock-"
# How long a process waits for another one's build of the same entry before building it too
# (a compile takes seconds; a holder that hangs must not hang every other process).
BUILD_LOCK_WAIT_S = 300.0
_LOCK_POLL_S = 0.05
# Bits that would let another user replace what we load.
_LEN = struct.Struct("<I")
_DIGEST = 32


def default_cache_dir() -> Path:
    env = os.environ.get("MEGAMOE_RT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "megamoe_rt"


@dataclass(frozen=True)
class CacheEntry:
    key: str
    meta: dict[str, Any]
    cubin: bytes


class UntrustedCacheWarning(UserWarning):
    """The configured cache directory could not be trusted; a private one is used instead."""


class CacheWriteWarning(UserWarning):
    """An entry could not be written or removed (read-only or full directory, an odd file in
    its place): the kernel runs from the cubin in memory and is rebuilt by the next process."""


def _private_fallback() -> Path:
    """A per-user directory under the system temp dir, made 0700; a fresh one if that is
    not trustworthy either."""
    uid = current_uid()
    cand = Path(tempfile.gettempdir()) / f"megamoe_rt-cache-{uid if uid is not None else 'user'}"
    try:
        os.makedirs(cand, mode=0o700, exist_ok=True)
        st = os.lstat(cand)
        if stat.S_ISDIR(st.st_mode) and untrusted_reason(st, str(cand)) is None:
            return cand
    except OSError:
        pass
    try:
        return Path(tempfile.mkdtemp(prefix="megamoe_rt-cache-"))
    except OSError:  # no room or no rights there either: entries are then not written (store warns)
        return cand


# (directory, kind) of the write troubles already warned of in this process.
_WARNED: set[tuple[str, str]] = set()


class CubinCache:
    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.rejected = 0  # entries found corrupt, foreign or malformed and removed (tests, `info`)
        self._checked = False

    def _warn_once(self, kind: str, message: str) -> None:
        """One warning per kind of trouble and directory in this process, not one per kernel:
        every build opens the cache afresh."""
        seen = (str(self.directory), kind)
        if seen in _WARNED:
            return
        _WARNED.add(seen)
        warnings.warn(f"megamoe_rt: {message}", CacheWriteWarning, stacklevel=4)

    def _ensure_dir(self) -> None:
        """Create the directory (0700), or check an existing one; fall back to a private
        directory, with a warning, when it cannot be trusted."""
        if self._checked:
            return
        try:
            if not os.path.lexists(self.directory):
                # 0700: cubins are loaded and executed, so other users must not plant them.
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                os.chmod(self.directory, 0o700)
            st = os.stat(self.directory)  # a link to a directory of one's own is fine
            reason = (
                f"{self.directory} is not a directory"
                if not stat.S_ISDIR(st.st_mode)
                else untrusted_reason(st, str(self.directory))
            )
        except OSError as exc:
            reason = f"{self.directory} cannot be created or read ({exc.strerror})"
        if reason is not None:
            fallback = _private_fallback()
            warnings.warn(
                f"megamoe_rt: not using the kernel cache: {reason}; using {fallback}",
                UntrustedCacheWarning,
                stacklevel=3,
            )
            self.directory = fallback
        self._checked = True

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def load(self, key: str) -> CacheEntry | None:
        if not os.path.isdir(self.directory):
            return None
        self._ensure_dir()
        blob, reason = read_trusted_file(self.path_for(key))
        if blob is None and reason is None:
            return None
        entry = self._parse(key, blob) if blob is not None else None
        if entry is None:
            self.reject(key)
        return entry

    def reject(self, key: str) -> None:
        """Remove an entry that must not be loaded (corrupt, foreign, or of an unexpected
        layout), so the next compile rebuilds it."""
        self.rejected += 1
        path = self.path_for(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a directory in its place, or a read-only cache directory
            self._warn_once("reject", f"cannot remove the unusable cache entry {path} ({exc.strerror}); it is ignored")

    @staticmethod
    def _parse(key: str, blob: bytes) -> CacheEntry | None:
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _LEN.size + _DIGEST:
            return None
        body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            return None
        blob = body
        pos = len(MAGIC)
        (hlen,) = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        if pos + hlen > len(blob):
            return None
        try:
            meta = json.loads(blob[pos : pos + hlen].decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        payload = blob[pos + hlen :]  # the trailing digest was already stripped
        if (
            not isinstance(meta, dict)
            or meta.get("key") != key
            or meta.get("cubin_bytes") != len(payload)
            or meta.get("cubin_sha256") != hashlib.sha256(payload).hexdigest()
        ):
            return None
        return CacheEntry(key, meta, payload)

    def store(self, key: str, cubin: bytes, meta: dict[str, Any]) -> Path | None:
        """Write an entry; None (with one warning) where it cannot be written."""
        self._ensure_dir()
        header = dict(meta, key=key, cubin_bytes=len(cubin), cubin_sha256=hashlib.sha256(cubin).hexdigest())
        hbytes = json.dumps(header, sort_keys=True).encode()
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".cubin", dir=self.directory)
        except OSError as exc:
            self._warn_once(
                "store", f"kernel cache {self.directory} is not writable ({exc.strerror}); kernels run from memory"
            )
            return None
        try:
            with os.fdopen(fd, "wb") as f:
                body = MAGIC + _LEN.pack(len(hbytes)) + hbytes + cubin
                f.write(body + hashlib.sha256(body).digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path_for(key))
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not isinstance(exc, OSError):
                raise
            self._warn_once(
                "store",
                f"cannot write the kernel cache entry {self.path_for(key)} ({exc.strerror}); kernels run from memory",
            )
            return None
        return self.path_for(key)

    @contextlib.contextmanager
    def building(self, key: str, *, wait_s: float = BUILD_LOCK_WAIT_S) -> Iterator[bool]:
        """Hold the build lock of ``key`` (advisory, per entry) for the body; yields whether
        it is held. After ``wait_s`` without it, or where locks are unavailable, the body
        runs unlocked: the entry is then built twice, which is correct, only slower."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            yield False
            return
        self._ensure_dir()
        try:
            fd = os.open(
                self.directory / f"{_LOCK_PREFIX}{key}",
                os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                0o600,
            )
        except OSError:  # a link planted in its place, or a read-only directory
            yield False
            return
        try:
            deadline = time.monotonic() + wait_s
            held = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(_LOCK_POLL_S)
                except OSError:  # no locks on this file system (ENOLCK on some network mounts)
                    break
            yield held
        finally:
            os.close(fd)  # releases the lock

    def entries(self) -> list[Path]:
        """Complete entries; another process's temporary files being written are not entries."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("*.cubin") if not p.name.startswith(_TMP_PREFIX))

    def clear(self) -> int:
        """Remove every entry (not the temporary files of writers still running)."""
        n = 0
        for p in self.entries():
            try:
                p.unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n
