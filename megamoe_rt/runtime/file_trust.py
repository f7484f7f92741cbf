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


def read_trusted_file(path: str | os.PathLike[str]) -> tuple[bytes | None, str | None]:
    """The bytes of a file only this user can write: ``(data, None)``; ``(None, None)`` where
    there is no such file; ``(None, reason)`` where something is there that must not be read
    (a link, a directory, a FIFO or device, a file another user owns or can write).

    The file is opened without following links and without blocking (a FIFO planted at the
    path would otherwise hang the open), and checked on the open descriptor, so it cannot be
    swapped between the check and the read."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, None
    except OSError as exc:  # a symbolic link (ELOOP), or unreadable
        return None, f"{path} cannot be opened ({exc.strerror})"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None, f"{path} is not a regular file"
    with os.fdopen(fd, "rb") as f:
        reason = untrusted_reason(st, str(path))
        if reason is not None:
            return None, reason
        try:
            return f.read(), None
        except OSError as exc:
            return None, f"{path} cannot be read ({exc.strerror})"
