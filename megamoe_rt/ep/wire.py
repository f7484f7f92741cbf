"""What travels between the ranks and the launch's hub (megamoe_rt/ep/hub.py), and how a
connection is opened.

A connection is a Unix socket speaking :mod:`multiprocessing.connection`'s framing and its
HMAC challenge with the launch's key (so ``multiprocessing.connection.Client`` can still probe
a hub), but no message is ever unpickled: a message is a JSON header, a dict, then raw bytes
(:func:`encode`). The hub checks every request's shape against :data:`REQUESTS`
(:func:`parse_request`) and answers a malformed one with an error reply, serving on.

The handshake runs with a socket timeout on both sides (:data:`HANDSHAKE_TIMEOUT_S`): a client
that connects and never answers the challenge costs the hub one thread for that long, and
nothing else; a hub that never sends one fails the client's call instead of holding it.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

MAX_MESSAGE = 64 << 20  # bytes of one message: broadcast values are small (ids, a trace's JSON)
MAX_KEY = 1024  # characters of a broadcast key
HANDSHAKE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 10.0  # a peer that does not read its reply cannot hold the hub's lock longer
_HEAD = struct.Struct("<I")


class MalformedMessage(ValueError):
    """A message that is not one of the protocol's (its reason says why)."""


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _HEAD.pack(len(head)) + head + bytes(payload)


def decode(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and payload of a message; :class:`MalformedMessage` for anything else."""
    if len(raw) < _HEAD.size:
        raise MalformedMessage(f"{len(raw)} bytes, fewer than a header's length")
    (n,) = _HEAD.unpack_from(raw)
    if n > len(raw) - _HEAD.size:
        raise MalformedMessage(f"a header of {n} bytes in a message of {len(raw)}")
    try:
        header = json.loads(raw[_HEAD.size : _HEAD.size + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise MalformedMessage("the header is not JSON") from None
    if not isinstance(header, dict):
        raise MalformedMessage(f"the header is a JSON {type(header).__name__}, not an object")
    return header, raw[_HEAD.size + n :]


# op -> its fields and their kinds: "rank" (0 <= v < world size), "count" (an int >= 1), "pid"
# (an int >= 1), "int|null" (an int >= 0 or null), "key" (a string of at most MAX_KEY characters).
REQUESTS: dict[str, dict[str, str]] = {
    "put": {"key": "key"},  # rank 0's broadcast value: the payload
    "get": {"key": "key", "root": "rank"},
    "barrier": {"gen": "count", "rank": "rank"},
    "hello": {"rank": "rank", "pid": "pid", "start": "int|null"},  # opens a rank's heartbeat
    "beat": {},
    "bye": {},  # the rank leaves the launch (its process is ending normally)
}
_WITH_PAYLOAD = {"put"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(raw: bytes, world_size: int) -> tuple[str, dict[str, Any], bytes]:
    """``(op, fields, payload)`` of a request, every field checked; :class:`MalformedMessage`
    naming what is wrong otherwise."""
    header, payload = decode(raw)
    op = header.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise MalformedMessage(f"unknown op {op!r}; expected one of {', '.join(REQUESTS)}")
    schema = REQUESTS[op]
    extra = set(header) - set(schema) - {"op"}
    if extra:
        raise MalformedMessage(f"{op}: unexpected fields {sorted(extra)}")
    fields: dict[str, Any] = {}
    for name, kind in schema.items():
        if name not in header:
            raise MalformedMessage(f"{op}: missing field {name!r}")
        v = header[name]
        ok = {
            "rank": _is_int(v) and 0 <= v < world_size,
            "count": _is_int(v) and v >= 1,
            "pid": _is_int(v) and v >= 1,
            "int|null": v is None or (_is_int(v) and v >= 0),
            "key": isinstance(v, str) and len(v) <= MAX_KEY,
        }[kind]
        if not ok:
            want = {
                "rank": f"a rank in [0, {world_size})",
                "count": "an integer >= 1",
                "pid": "a process id",
                "int|null": "an integer >= 0 or null",
                "key": f"a string of at most {MAX_KEY} characters",
            }[kind]
            raise MalformedMessage(f"{op}: field {name!r} is {v!r}, expected {want}")
        fields[name] = v
    if payload and op not in _WITH_PAYLOAD:
        raise MalformedMessage(f"{op}: carries {len(payload)} bytes it has no use for")
    return op, fields, payload


def parse_reply(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """A reply from the hub: ``{"status": "ok"|"error"|"closing", ...}`` and its payload."""
    header, payload = decode(raw)
    status = header.get("status")
    if status not in ("ok", "error", "closing"):
        raise MalformedMessage(f"reply status {status!r}")
    if status == "error" and not isinstance(header.get("message"), str):
        raise MalformedMessage("an error reply without a message")
    if "failed_rank" in header and not _is_int(header["failed_rank"]):
        raise MalformedMessage(f"failed_rank {header['failed_rank']!r}")
    failed = header.get("failed", [])
    if not (
        isinstance(failed, list)
        and all(isinstance(f, list) and len(f) == 2 and _is_int(f[0]) and isinstance(f[1], str) for f in failed)
    ):
        raise MalformedMessage(f"failed {failed!r}")
    return header, payload


# --- sockets -----------------------------------------------------------------------------------


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


def set_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """Kernel-level timeouts (0: none) that hold for every descriptor of ``sock``, the blocking
    reads and writes of a :class:`Connection` on a duplicate of it included: a read past
    ``recv_s`` raises ``BlockingIOError``."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))


class Link:
    """One connection: the :class:`Connection` that frames messages, and the socket under it
    (for timeouts, and :meth:`shutdown` from another thread to end a read in progress)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.conn = Connection(sock.dup().detach())

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.conn.send_bytes(encode(header, payload))

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        finally:
            self.sock.close()


def accept(sock: socket.socket, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Link | None:
    """The hub's side of a new connection: the challenge both ways within ``timeout_s``; None
    (the connection closed) when it fails or stalls."""
    try:
        set_timeouts(sock, timeout_s, timeout_s)
        link = Link(sock)
    except OSError:
        sock.close()
        return None
    try:
        deliver_challenge(link.conn, key)
        answer_challenge(link.conn, key)
        set_timeouts(sock, 0, SEND_TIMEOUT_S)
    except Exception:  # a wrong key (AuthenticationError), a stalled or vanished client
        link.close()
        return None
    return link


def connect(
    address: str, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S, *, track: Callable[[Link], None] | None = None
) -> Link:
    """A rank's side: connect and answer the hub's challenge within ``timeout_s``. Raises
    OSError (no hub listening there, a stalled one), EOFError, or
    ``multiprocessing.AuthenticationError``. ``track`` gets the link before the handshake (so
    that another thread can shut it down while it waits)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.settimeout(None)
        set_timeouts(sock, timeout_s, timeout_s)
        link = Link(sock)
    except BaseException:
        sock.close()
        raise
    if track is not None:
        track(link)
    try:
        answer_challenge(link.conn, key)
        deliver_challenge(link.conn, key)
        set_timeouts(sock, 0, SEND_TIMEOUT_S)
    except BaseException:
        link.close()
        raise
    return link
