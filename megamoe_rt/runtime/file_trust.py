"""Whether a file or directory on a shared host may be trusted: owned by this user and not
writable by anyone else (the cubin cache: others must not plant code), and for secrets not
readable either (the rendezvous file of launched ranks carries the hub's key)."""

from __future__ import annotations

import os
import stat

_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH
_FOREIGN_ANY = stat.S_IRWXG | stat.S_IRWXO


def current_uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def untrusted_reason(st: os.stat_result, what: str, *, private: bool = False) -> str | None:
    """Why a file or directory with this stat must not be trusted, or None. ``private``: no
    access at all for group or others (it holds a secret), not only no write."""
    uid = current_uid()
    if uid is not None and st.st_uid != uid:
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (_FOREIGN_ANY if private else _FOREIGN_WRITE):
        kind = "open to" if private else "writable by"
        return f"{what} is {kind} group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None
