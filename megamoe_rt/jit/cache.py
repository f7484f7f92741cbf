"""On-disk cubin cache with verified entries.

Layout: ``$MEGAMOE_RT_CACHE`` (default ``~/.cache/megamoe_rt``, created 0700),
one file per key. An entry is ``MAGIC | u32 header length | JSON header | cubin |
SHA-256 of everything before it``; the header carries the key and the cubin's
length, and the trailing digest covers header and cubin alike. Entries are
written to a temporary file in the same directory and renamed into place, so a
reader sees either nothing or a whole file; a truncated or altered entry fails
verification, is removed and rebuilt, and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"MMRTCUBIN2\n"
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
    meta: dict
    cubin: bytes


class CubinCache:
    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.rejected = 0  # entries found corrupt and removed (observable for tests and `info`)

    def _ensure_dir(self) -> None:
        if not self.directory.is_dir():
            # 0700: cubins are loaded and executed, so other users must not plant them.
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            os.chmod(self.directory, 0o700)

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def load(self, key: str) -> CacheEntry | None:
        path = self.path_for(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        entry = self._parse(key, blob)
        if entry is None:
            self.rejected += 1
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        return entry

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

    def store(self, key: str, cubin: bytes, meta: dict) -> Path:
        self._ensure_dir()
        header = dict(meta, key=key, cubin_bytes=len(cubin), cubin_sha256=hashlib.sha256(cubin).hexdigest())
        hbytes = json.dumps(header, sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".cubin", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                body = MAGIC + _LEN.pack(len(hbytes)) + hbytes + cubin
                f.write(body + hashlib.sha256(body).digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path_for(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return self.path_for(key)

    def entries(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob("*.cubin"))

    def clear(self) -> int:
        n = 0
        for p in self.entries():
            p.unlink()
            n += 1
        return n
