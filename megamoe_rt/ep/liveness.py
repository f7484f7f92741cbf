"""Whether the ranks of a launch are still there, and ranks that do not outlive their launcher.

**Heartbeats.** Every rank of ``megamoe-rt launch``, :func:`~megamoe_rt.ep.launch.spawn`,
torchrun or srun keeps one connection to the launch's hub open (:class:`Heartbeat`) and sends
a beat on it every second; the hub answers each with the ranks it has declared failed. The hub
declares a rank failed (megamoe_rt/ep/hub.py):

- *died*: its connection closed without the goodbye a rank sends when its process ends
  normally (killed, ``os._exit``, a crash): at once;
- *stopped responding*: no beat for ``$MEGAMOE_RT_HEARTBEAT_TIMEOUT_S`` (default 5 s) and its
  process is stopped (SIGSTOP, a debugger) or cannot be inspected, or no beat for
  :data:`BUSY_FACTOR` times that while its process runs (a native call holding the GIL).

It then fails, with :class:`RankFailed` naming that rank, every exchange waiting at the hub
and every later one, and marks the rank in the status board so an all-gather waiting for it
fails too. A rank learns of a failure that way, or from its heartbeat's answer.

Where rank 0 serves the hub (torchrun, srun), the hub goes with rank 0; the others find out
through their heartbeat: its connection closed without the hub's closing notice (rank 0 died),
or no answer for the timeout while rank 0's process is stopped. They then record rank 0 as
failed, mark it in the board and end their calls in progress at the hub.

**Parent death.** A rank started by ``megamoe-rt launch`` or spawn gets ``SIGKILL`` when its
launcher dies (Linux ``PR_SET_PDEATHSIG``, :func:`die_with_parent`), and its heartbeat thread
ends the process when its parent changes or the launcher's hub vanishes without a closing
notice (other systems, or a launcher that died before the signal was set).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from typing import Any

from megamoe_rt.ep import board as status_board
from megamoe_rt.ep import wire
from megamoe_rt.runtime.deadlines import env_seconds

HEARTBEAT_TIMEOUT_ENV = "MEGAMOE_RT_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
# A rank whose process is running (not stopped) but sends no beat gets this many timeouts: a
# long native call that holds the GIL (a compiler, a driver call) is not a failure.
BUSY_FACTOR = 12
LAUNCHER_PID_ENV = "MEGAMOE_RT_LAUNCHER_PID"


def heartbeat_timeout_s() -> float:
    return env_seconds(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S)


def beat_interval_s(timeout_s: float) -> float:
    return min(1.0, timeout_s / 4)


class RankFailed(RuntimeError):
    """A rank raised, exited with a non-zero status, died or stopped responding; ``rank`` names
    it. Raised by :func:`~megamoe_rt.ep.launch.spawn` (the other ranks were stopped), and on
    the surviving ranks by the group's collectives."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.detail))


# --- processes ---------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` past the command name (field 3, the state, first), or None."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        text = f.read()
    return text.rpartition(")")[2].split()


def own_start_time() -> int | None:
    """This process's start time in clock ticks since boot (tells a pid reused apart), or None."""
    try:
        fields = _stat_fields(os.getpid())
        return int(fields[19]) if fields and len(fields) > 19 else None
    except (OSError, ValueError):
        return None


def process_state(pid: int, start: int | None = None) -> str:
    """``"running"``, ``"stopped"`` (SIGSTOP, a debugger), ``"gone"`` (ended, a zombie, or the
    pid taken by another process since ``start``) or ``"unknown"`` (no /proc to look in)."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return "gone" if os.path.exists("/proc/self/stat") else "unknown"
    except OSError:
        return "unknown"
    if not fields:
        return "unknown"
    if start is not None and len(fields) > 19 and fields[19] != str(start):
        return "gone"
    state = fields[0]
    if state in ("Z", "X", "x"):
        return "gone"
    if state in ("T", "t"):
        return "stopped"
    return "running"


def signal_note(code: int | None) -> str:
    """`` (killed by SIGKILL)`` for a negative exit status, else empty."""
    if code is None or code >= 0:
        return ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f" (killed by {name})"


_PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def _orphaned(parent_pid: int) -> None:
    try:
        os.write(2, f"megamoe-rt: this rank's launcher (pid {parent_pid}) is gone; the rank exits\n".encode())
    except OSError:
        pass
    os._exit(1)


def die_with_parent(parent_pid: int) -> bool:
    """In a rank the launcher ``parent_pid`` started: be killed (SIGKILL) when it dies (Linux);
    exit now when it is already gone. A process further down (a rank's own child with the
    rank's environment) is left alone while the launcher lives. True when the kernel will do it."""
    if os.getppid() != parent_pid:
        if process_state(parent_pid) == "gone":
            _orphaned(parent_pid)
        return False
    prctl = _prctl()
    armed = prctl is not None and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent_pid:  # it died before the line above
        _orphaned(parent_pid)
    return armed


def preexec_die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ranks the launcher starts: the child gets SIGKILL when the
    launcher dies, from before it runs a line of Python. Only a function resolved here runs
    between fork and exec (no import, no lock)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above
            os._exit(1)

    return preexec


# --- a rank's heartbeat --------------------------------------------------------------------------


class HubLost(RuntimeError):
    """The launcher's hub vanished or stopped answering (no rank to name)."""


class Heartbeat:
    """A rank's connection to the hub that carries its beats (one daemon thread).

    ``hub_rank``: the rank whose process serves the hub (0 under torchrun and srun), None for
    the launcher's own hub. ``parent_pid``: the launcher's pid, where the rank must not outlive
    it (``megamoe-rt launch``, spawn).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        key: bytes,
        *,
        hub_rank: int | None,
        parent_pid: int | None = None,
        board_path: str | None = None,
    ):
        self.rank, self.world_size, self.address, self.key = rank, world_size, address, key
        self.hub_rank = hub_rank
        self.parent_pid = parent_pid
        self.timeout_s = heartbeat_timeout_s()
        self.failure: Exception | None = None  # the first failure learnt of
        self.hub_closed = False  # the hub sent its closing notice: it ended normally
        self._board_path = board_path
        self._board: status_board.StatusBoard | None = None
        self._link: wire.Link | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._left = False
        self._hub_pid: int | None = None
        self._hub_start: int | None = None
        self._inflight: set[wire.Link] = set()
        self._inflight_lock = threading.Lock()
        self._on_failure: list[Callable[[], None]] = []

    # -- start, leave --

    def start(self) -> None:
        """Register with the hub (``hello``) and start beating. Raises what connecting raises."""
        link = wire.connect(self.address, self.key)
        try:
            link.send({"op": "hello", "rank": self.rank, "pid": os.getpid(), "start": own_start_time()})
            if not link.conn.poll(wire.HANDSHAKE_TIMEOUT_S):
                raise TimeoutError(f"rank {self.rank}: the hub did not answer its heartbeat registration")
            header, _ = wire.parse_reply(link.conn.recv_bytes(wire.MAX_MESSAGE))
        except BaseException:
            link.close()
            raise
        if header["status"] != "ok":
            link.close()
            raise RuntimeError(f"rank {self.rank}: the hub refused its heartbeat: {header.get('message')}")
        pid, start = header.get("pid"), header.get("start")
        self._hub_pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        self._hub_start = start if isinstance(start, int) and not isinstance(start, bool) else None
        self._link = link
        self._take_failures(header)
        if self._board_path is not None:
            try:
                self._board = status_board.StatusBoard(self._board_path, self.world_size)
            except OSError:
                self._board = None
        self._ppid = os.getppid()
        os.register_at_fork(after_in_child=self._forget_in_child)
        atexit.register(self.leave)
        threading.Thread(target=self._run, daemon=True, name=f"megamoe-rt-heartbeat-{self.rank}").start()

    def leave(self) -> None:
        """Say goodbye (the rank is ending normally) and stop beating; idempotent."""
        with self._send_lock:
            if self._left:
                return
            self._left = True
            self._stop.set()
            link = self._link
            if link is not None:
                try:
                    link.send({"op": "bye"})
                except (OSError, ValueError):
                    pass
        if link is not None:
            link.close()

    def _forget_in_child(self) -> None:
        """A forked child (a data loader's worker) neither beats nor holds the connection open
        (the hub must see the rank's death when the rank dies)."""
        self._left = True
        self._stop.set()
        link, self._link = self._link, None  # no lock taken: another thread may have held it at the fork
        self._inflight = set()
        if link is not None:
            try:
                link.close()  # the child's copies of the descriptors only
            except OSError:
                pass

    # -- what calls consult --

    def track(self, link: wire.Link) -> None:
        """A call in progress at the hub: ended (its socket shut down) when the hub is lost."""
        with self._inflight_lock:
            self._inflight = {k for k in self._inflight if k.sock.fileno() != -1}  # closed ones
            self._inflight.add(link)
            lost = self.failure is not None
        if lost:  # the hub was lost between the call's look at it and here
            link.shutdown()

    def untrack(self, link: wire.Link) -> None:
        with self._inflight_lock:
            self._inflight.discard(link)

    # -- the thread --

    def _take_failures(self, header: dict[str, Any]) -> None:
        for rank, detail in header.get("failed", []):
            if self.failure is None:
                self.failure = RankFailed(rank, detail)

    def _run(self) -> None:
        interval = beat_interval_s(self.timeout_s)
        while not self._stop.is_set():
            link = self._link
            if link is None:
                return
            try:
                with self._send_lock:
                    if self._left:
                        return
                    link.send({"op": "beat"})
                sent = time.monotonic()
                while not link.conn.poll(min(interval, self.timeout_s)):
                    if self._stop.is_set():
                        return
                    waited = time.monotonic() - sent
                    # An answer that arrived while this thread waited since its poll is read first.
                    if waited > self.timeout_s and not link.conn.poll(0):
                        state = process_state(self._hub_pid, self._hub_start) if self._hub_pid else "unknown"
                        if state != "running" or waited > BUSY_FACTOR * self.timeout_s:
                            self._hub_lost(f"no answer to its heartbeat for {waited:.1f} s", state)
                            return
                header, _ = wire.parse_reply(link.conn.recv_bytes(wire.MAX_MESSAGE))
                if header["status"] == "closing":
                    self.hub_closed = True
                    return
                self._take_failures(header)
                if self.parent_pid is not None and os.getppid() != self._ppid:
                    _orphaned(self.parent_pid)
                # Between beats, watch the connection: the hub's end (its closing notice, or the
                # connection closing with its process) is seen at once, not at the next beat.
                if link.conn.poll(interval):
                    header, _ = wire.parse_reply(link.conn.recv_bytes(wire.MAX_MESSAGE))
                    if header["status"] == "closing":
                        self.hub_closed = True
                        return
                    self._take_failures(header)
            except (EOFError, OSError, wire.MalformedMessage, AuthenticationError):
                if not self._stop.is_set():
                    self._hub_lost("its connection closed", "gone")
                return

    def _hub_lost(self, how: str, state: str) -> None:
        """The hub is gone (``state`` "gone") or does not answer."""
        if self.hub_rank is None:
            if state == "gone" and self.parent_pid is not None:
                _orphaned(self.parent_pid)  # the launcher died: so does the rank
            failure: Exception = HubLost(f"rank {self.rank}: the launcher's hub is lost ({how})")
        else:
            r = self.hub_rank
            if state == "gone":
                detail = f"its process, which served the launch's hub, died ({how})"
                mark = status_board.DIED
            else:
                stopped = {
                    "stopped": " and its process is stopped",
                    "running": f"; raise ${HEARTBEAT_TIMEOUT_ENV} if it was only busy",
                }.get(state, "")
                detail = f"it serves the launch's hub, which gave no answer ({how}){stopped}"
                mark = status_board.STALLED
            failure = RankFailed(r, detail)
            if self._board is not None:
                try:
                    self._board.mark_gone(r, mark)
                except (ValueError, OSError):
                    pass
        if self.failure is None:
            self.failure = failure
        with self._inflight_lock:
            links = list(self._inflight)
        for link in links:
            link.shutdown()
