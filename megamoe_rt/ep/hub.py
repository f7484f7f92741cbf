"""The hub the ranks of one launch meet at: broadcasts (by key, from a root rank), barriers, and
the ranks' heartbeats (megamoe_rt/ep/liveness.py).

It listens on a Unix socket in a fresh private directory (``tempfile.mkdtemp``: mode 0700,
owned by the user, a new name per launch, so nothing another user planted is used), next to
the launch's status board. Each connection's handshake runs in its own thread with a timeout
(megamoe_rt/ep/wire.py): a client that never completes it delays no one else. Every request is
checked before it is used; a malformed one gets an error reply and the connection is served on.

Every reply is ``{"status": "ok"}`` (with the value as payload) or ``{"status": "error",
"message": ...}``; an error caused by a failed rank also carries ``failed_rank``. A rank that
leaves (its goodbye, or the launcher's :meth:`Hub.rank_exited`) fails the exchanges it can no
longer join; a rank that dies or stops responding fails every exchange waiting and every later
one (``failed_rank``), and is marked in the status board.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import tempfile
import threading
import time
from typing import Any

from megamoe_rt.ep import board as status_board
from megamoe_rt.ep import liveness, wire
from megamoe_rt.runtime.file_trust import untrusted_reason


def board_path(hub_address: str) -> str:
    """The launch's status board (megamoe_rt/ep/board.py), next to the hub's socket."""
    return os.path.join(os.path.dirname(hub_address), "board")


def report_path(hub_address: str) -> str:
    """Where a rank leaves the line saying what it lacks to run (megamoe_rt/ep/env.py)."""
    return os.path.join(os.path.dirname(hub_address), "report")


def private_temp_dir(prefix: str = "megamoe-rt-") -> str:
    """A new directory only this user can enter (``mkdtemp`` creates it 0700 under a name no
    one chose before); checked once more after creation."""
    path = tempfile.mkdtemp(prefix=prefix)
    st = os.lstat(path)
    reason = untrusted_reason(st, path, private=True) if stat.S_ISDIR(st.st_mode) else f"{path} is not a directory"
    if reason is not None:
        raise RuntimeError(f"hub directory: {reason}")
    return path


def _reply(link: wire.Link, header: dict[str, Any], payload: bytes = b"") -> None:
    """Send to a rank that may have stopped listening (its call timed out, its process ended):
    that rank's problem, never the hub's (its other clients still need their replies). The
    socket's send timeout bounds a rank that does not read."""
    try:
        link.send(header, payload)
    except (OSError, EOFError, ValueError):
        pass


# Replies decided under the hub's lock and sent after it is released: a rank that does not read
# its reply (its socket's send timeout bounds that) then delays no other rank's exchange or
# heartbeat. A link has at most one reply outstanding (its rank waits for it before asking
# again) and each is taken out of the hub's tables under the lock, so no two threads send on
# one link at once.
Outbox = list[tuple[wire.Link, dict[str, Any], bytes]]


def _send_all(outbox: Outbox) -> None:
    for link, header, payload in outbox:
        _reply(link, header, payload)


def _error(message: str, failed_rank: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "error", "message": message}
    if failed_rank is not None:
        out["failed_rank"] = failed_rank
    return out


class _Peer:
    """A rank's heartbeat connection as the hub sees it."""

    def __init__(self, rank: int, link: wire.Link, pid: int, start: int | None):
        self.rank, self.link, self.pid, self.start = rank, link, pid, start
        self.last_beat = time.monotonic()
        self.lock = threading.Lock()  # the serving thread's answers and close()'s notice

    def send(self, header: dict[str, Any]) -> None:
        with self.lock:
            _reply(self.link, header)


class Hub:
    """Serves the ranks of one launch (see the module docstring)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.key = secrets.token_bytes(32)
        self._dir = private_temp_dir()
        self.address = os.path.join(self._dir, "hub.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(128)
        status_board.create(board_path(self.address), world_size)
        self._board = status_board.StatusBoard(board_path(self.address), world_size)
        self._values: dict[str, bytes] = {}
        self._waiting: dict[str, list[tuple[wire.Link, int]]] = {}
        self._barriers: dict[int, list[tuple[wire.Link, int]]] = {}
        self._exited: set[int] = set()
        self._failed: dict[int, str] = {}  # in the order declared
        self._stalled: set[int] = set()  # of those, the ones that stopped responding (not dead)
        self._left: list[int] = []  # ranks in the order they left, failed or not
        self._peers: dict[int, _Peer] = {}
        self._open = 0  # request connections being served (heartbeats not counted)
        self._lock = threading.Lock()
        self._closed = False
        self._pid, self._start = os.getpid(), liveness.own_start_time()
        self.heartbeat_timeout_s = liveness.heartbeat_timeout_s()
        threading.Thread(target=self._accept, daemon=True, name="megamoe-rt-hub").start()

    # -- what the launcher asks --

    def first_failure(self) -> tuple[int, str] | None:
        """The rank declared failed first (died, stopped responding) and why, or None."""
        with self._lock:
            for rank, detail in self._failed.items():
                return rank, detail
        return None

    def failures(self) -> dict[int, str]:
        with self._lock:
            return dict(self._failed)

    def stalled(self) -> set[int]:
        """Ranks declared failed because they stopped responding (their process may still be there)."""
        with self._lock:
            return set(self._stalled)

    def left_order(self) -> list[int]:
        """Ranks in the order the hub saw them leave (goodbye, death, stall)."""
        with self._lock:
            return list(self._left)

    def registered(self) -> set[int]:
        """Ranks whose heartbeat the hub has seen."""
        with self._lock:
            return set(self._peers) | set(self._exited) | set(self._failed)

    # -- connections --

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors, say: keep serving the ranks
                continue
            threading.Thread(target=self._connection, args=(sock,), daemon=True).start()

    def _connection(self, sock: socket.socket) -> None:
        link = wire.accept(sock, self.key, wire.HANDSHAKE_TIMEOUT_S)  # here: a stalled client holds only this thread
        if link is None:
            return
        with self._lock:
            self._open += 1
        counted = True
        try:
            while True:
                try:
                    raw = link.conn.recv_bytes(wire.MAX_MESSAGE)
                except EOFError:
                    return
                except OSError as exc:  # longer than MAX_MESSAGE: the stream cannot be read on
                    if "bad message length" in str(exc):
                        _reply(link, _error(f"malformed request: longer than {wire.MAX_MESSAGE} bytes"))
                    return
                try:
                    op, fields, payload = wire.parse_request(raw, self.world_size)
                except wire.MalformedMessage as exc:
                    _reply(link, _error(f"malformed request: {exc}"))
                    continue
                if op == "hello":
                    with self._lock:
                        self._open -= 1
                    counted = False
                    self._watch(link, fields)
                    return
                if op in ("beat", "bye"):
                    _reply(link, _error(f"malformed request: {op} before hello"))
                    continue
                self._request(link, op, fields, payload)
        finally:
            if counted:
                with self._lock:
                    self._open -= 1
            link.close()

    def _request(self, link: wire.Link, op: str, f: dict[str, Any], payload: bytes) -> None:
        outbox: Outbox = []
        with self._lock:
            failed = next(iter(self._failed.items()), None)
            if op == "put":
                self._values[f["key"]] = payload
                for c, _ in self._waiting.pop(f["key"], []):
                    outbox.append((c, {"status": "ok"}, payload))
                outbox.append((link, {"status": "ok"}, b""))
            elif op == "get":
                key, root = f["key"], f["root"]
                if key in self._values:
                    outbox.append((link, {"status": "ok"}, self._values[key]))
                elif failed is not None:
                    outbox.append((link, _error(failed[1], failed[0]), b""))
                elif root in self._exited:
                    outbox.append((link, _error(self._gone(root, f"broadcast {key!r}")), b""))
                else:
                    self._waiting.setdefault(key, []).append((link, root))
            elif op == "barrier":
                gen = f["gen"]
                if failed is not None:
                    outbox.append((link, _error(failed[1], failed[0]), b""))
                else:
                    group = self._barriers.setdefault(gen, [])
                    group.append((link, f["rank"]))
                    missing = set(range(self.world_size)) - {r for _, r in group}
                    if not missing:
                        outbox.extend((c, {"status": "ok"}, b"") for c, _ in self._barriers.pop(gen))
                    elif missing & self._exited:
                        outbox.extend(self._fail_barrier(gen, min(missing & self._exited)))
        _send_all(outbox)

    def _gone(self, rank: int, what: str) -> str:
        return f"rank {rank} exited without joining {what}"

    def _fail_barrier(self, gen: int, rank: int) -> Outbox:
        """The replies that fail barrier ``gen`` (called under the lock; sent after it)."""
        return [(c, _error(self._gone(rank, f"barrier #{gen}")), b"") for c, _ in self._barriers.pop(gen, [])]

    # -- heartbeats --

    def _failed_list(self) -> list[list[Any]]:
        with self._lock:
            return [[r, d] for r, d in self._failed.items()]

    def _watch(self, link: wire.Link, f: dict[str, Any]) -> None:
        rank = f["rank"]
        peer = _Peer(rank, link, f["pid"], f["start"])
        with self._lock:
            taken = rank in self._peers
            if not taken:
                self._peers[rank] = peer
        if taken:
            _reply(link, _error(f"rank {rank} already has a heartbeat"))
            return
        peer.send({"status": "ok", "pid": self._pid, "start": self._start, "failed": self._failed_list()})
        timeout = self.heartbeat_timeout_s
        declared = False
        try:
            while not self._closed:
                try:
                    ready = link.conn.poll(0.25)
                    raw = link.conn.recv_bytes(wire.MAX_MESSAGE) if ready else None
                except (EOFError, OSError):
                    if not self._closed and not declared:
                        self._declare(
                            rank,
                            status_board.DIED,
                            f"its process (pid {peer.pid}) died: its connection to the hub closed without the "
                            "goodbye of a normal exit (killed, or it exited abruptly)",
                        )
                    return
                if raw is None:
                    age = time.monotonic() - peer.last_beat
                    if declared or age <= timeout:
                        continue
                    # This thread may itself have waited (for the GIL, say) since its poll: a beat
                    # that arrived meanwhile is read first, so a busy hub blames no healthy rank.
                    if link.conn.poll(0):
                        continue
                    state = liveness.process_state(peer.pid, peer.start)
                    if state == "gone":
                        declared = True
                        self._declare(rank, status_board.DIED, f"its process (pid {peer.pid}) has ended")
                    elif state != "running" or age > liveness.BUSY_FACTOR * timeout:
                        declared = True
                        why = {
                            "stopped": "its process is stopped (SIGSTOP or a debugger)",
                            "unknown": "its process cannot be inspected",
                        }.get(
                            state,
                            f"its process runs but does not answer; raise ${liveness.HEARTBEAT_TIMEOUT_ENV} "
                            "if it was only busy",
                        )
                        self._declare(
                            rank,
                            status_board.STALLED,
                            f"stopped responding: no heartbeat for {age:.1f} s (pid {peer.pid}; {why})",
                        )
                    continue
                try:
                    op, _, _ = wire.parse_request(raw, self.world_size)
                except wire.MalformedMessage as exc:
                    peer.send(_error(f"malformed request: {exc}"))
                    continue
                if op == "beat":
                    peer.last_beat = time.monotonic()
                    peer.send({"status": "ok", "failed": self._failed_list()})
                elif op == "bye":
                    self.rank_exited(rank)
                    return
                else:
                    peer.send(_error(f"malformed request: {op} on a heartbeat connection"))
        finally:
            with self._lock:
                if self._peers.get(rank) is peer:
                    del self._peers[rank]

    def _declare(self, rank: int, how: int, detail: str) -> None:
        """``rank`` died or stopped responding: fail every exchange waiting, mark the board."""
        outbox: Outbox = []
        with self._lock:
            if rank in self._failed or rank in self._exited or self._closed:
                return
            self._failed[rank] = detail
            if how == status_board.STALLED:
                self._stalled.add(rank)
            self._left.append(rank)
            try:
                self._board.mark_gone(rank, how)
            except ValueError:  # the board is closed
                pass
            for gen in list(self._barriers):
                outbox.extend((c, _error(detail, rank), b"") for c, _ in self._barriers.pop(gen))
            for key in list(self._waiting):
                outbox.extend((c, _error(detail, rank), b"") for c, _ in self._waiting.pop(key))
        _send_all(outbox)

    def rank_exited(self, rank: int) -> None:
        """``rank`` has ended normally (its goodbye, or the launcher saw it exit): fail what it
        can no longer join."""
        outbox: Outbox = []
        with self._lock:
            if rank in self._exited or rank in self._failed or self._closed:
                return
            self._exited.add(rank)
            self._left.append(rank)
            try:
                self._board.mark_gone(rank)
            except ValueError:
                pass
            for gen, group in list(self._barriers.items()):
                if rank not in {r for _, r in group}:
                    outbox.extend(self._fail_barrier(gen, rank))
            for key, waiters in list(self._waiting.items()):
                outbox.extend(
                    (c, _error(self._gone(rank, f"broadcast {key!r}")), b"") for c, root in waiters if root == rank
                )
                self._waiting[key] = [w for w in waiters if w[1] != rank]
        _send_all(outbox)

    # -- the end --

    def close_when_idle(self, wait_s: float = 5.0) -> None:
        """Close once no rank is in the middle of a call (at most ``wait_s`` later): a hub served
        from a rank's own process must not vanish under a peer's last exchange."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._open == 0:
                    break
            time.sleep(0.01)
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        for peer in peers:  # a closing notice: the ranks tell this from the hub's death
            peer.send({"status": "closing"})
            peer.link.shutdown()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # ends the accept() in progress
        except OSError:
            pass
        self._sock.close()
        self._board.close()
        for path in (self.address, board_path(self.address), report_path(self.address)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        os.rmdir(self._dir)
