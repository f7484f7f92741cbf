"""One process per GPU: ``spawn(fn, nprocs)`` and ``megamoe-rt launch -n N script.py``.

Ranks bootstrap through a small hub the launcher runs on a local socket (no MPI,
megamoe_rt/ep/hub.py): rank 0 can broadcast bytes (an NVSHMEM unique id) to the others, and
all can meet at a barrier. NVLink multicast stays off in every rank
(``NVSHMEM_DISABLE_NVLS=1``, ``NCCL_NVLS_ENABLE=0``). Every rank keeps a heartbeat to the hub
(megamoe_rt/ep/liveness.py): a rank that dies or stops responding is reported, naming it, on
the others within seconds. When a rank raises or dies, the launcher stops the others and
reports the failing rank's error; no process is left behind, and a rank does not outlive a
launcher that was killed.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from typing import Any

from megamoe_rt.ep import board as status_board
from megamoe_rt.ep import liveness, wire
from megamoe_rt.ep.env import LAUNCH_REPORT_ENV, RANK_DEVICES_ENV, assigned_device, rank_env, read_launch_report
from megamoe_rt.ep.group import RankGroup, frame, unframe
from megamoe_rt.ep.hub import Hub, board_path, report_path
from megamoe_rt.ep.liveness import LAUNCHER_PID_ENV, RankFailed, signal_note
from megamoe_rt.runtime import args as arg_checks
from megamoe_rt.runtime.deadlines import env_seconds

__all__ = [
    "DEFAULT_HUB_TIMEOUT_S",
    "HUB_TIMEOUT_ENV",
    "RankContext",
    "RankFailed",
    "board_path",
    "context_from_env",
    "hub_timeout_s",
    "launch_script",
    "launched",
    "report_path",
    "spawn",
]

_ENV_RANK, _ENV_WORLD, _ENV_HUB, _ENV_KEY = (
    "MEGAMOE_RT_RANK",
    "MEGAMOE_RT_WORLD_SIZE",
    "MEGAMOE_RT_HUB",
    "MEGAMOE_RT_HUB_KEY",
)
_GRACE_S = 5.0
# After a rank fails, how long the launcher lets the others end on their own (each waiting at
# the hub was told at once and says so) before it stops them.
_REPORT_GRACE_S = 1.0
_POLL_S = 0.2  # a call waiting at the hub looks for a failure its heartbeat learnt of this often
# How long a rank waits at the hub (a broadcast's value, a barrier's other ranks) before it
# gives up naming the exchange. Generous: a peer may be compiling kernels on a cold cache.
HUB_TIMEOUT_ENV = "MEGAMOE_RT_HUB_TIMEOUT_S"
DEFAULT_HUB_TIMEOUT_S = 600.0


def hub_timeout_s() -> float:
    return env_seconds(HUB_TIMEOUT_ENV, DEFAULT_HUB_TIMEOUT_S)


_Hub = Hub  # the name the tests and older callers use


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a TypeError; also a ValueError, which launch_script
    raised for these before)."""


# --- what a rank sees ------------------------------------------------------------------------


@dataclass
class RankContext:
    """A rank started by ``megamoe-rt launch`` or :func:`spawn`, or by torchrun or srun on one
    node (a :class:`RankGroup`). ``hub_rank``: the rank whose process serves the hub (0 under
    torchrun and srun), None where the launcher serves it."""

    rank: int
    world_size: int
    hub_address: str
    hub_key: bytes
    device_ordinal: int | None = None  # None: the rank (ranks map onto the visible devices in order)
    hub_rank: int | None = None
    _uses: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _board: status_board.StatusBoard | None = field(default=None, init=False, repr=False, compare=False)
    _heartbeat: liveness.Heartbeat | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def device(self) -> int:
        """This rank's GPU ordinal: ranks map onto the visible devices in order, unless the
        launcher gave each rank its own (``device_ordinal``) or ``$MEGAMOE_RT_RANK_DEVICES``
        assigns them (megamoe_rt/ep/env.py)."""
        if self.device_ordinal is not None:
            return self.device_ordinal
        assigned = assigned_device(self.rank)
        return self.rank if assigned is None else assigned

    # -- liveness --

    def start_heartbeat(self, parent_pid: int | None = None) -> None:
        """Register with the hub and keep beating (megamoe_rt/ep/liveness.py): from now on this
        rank's death or stall is reported on the others, and theirs here. ``parent_pid``: the
        launcher, which this rank must not outlive."""
        if self._heartbeat is not None:
            return
        hb = liveness.Heartbeat(
            self.rank,
            self.world_size,
            self.hub_address,
            self.hub_key,
            hub_rank=self.hub_rank,
            parent_pid=parent_pid,
            board_path=board_path(self.hub_address),
        )
        try:
            hb.start()
        except (OSError, EOFError, AuthenticationError) as exc:
            raise self._unreachable("registering its heartbeat", exc) from None
        self._heartbeat = hb

    def leave(self) -> None:
        """This rank is done with the launch (it also happens at a normal exit): the others stop
        waiting for it, and do not take its end for a failure."""
        if self._heartbeat is not None:
            self._heartbeat.leave()

    def peer_failure(self) -> Exception | None:
        """The first failure of another rank (or of the hub) this rank has learnt of, or None."""
        return None if self._heartbeat is None else self._heartbeat.failure

    def _known_failure(self, what: str) -> Exception | None:
        failure = self.peer_failure()
        if isinstance(failure, RankFailed):
            return RankFailed(failure.rank, f"{failure.detail} (rank {self.rank}: {what})")
        if failure is not None:
            return RuntimeError(f"{failure} (rank {self.rank}: {what})")
        return None

    def _unreachable(self, what: str, exc: BaseException) -> Exception:
        """What a call that cannot reach the hub (refused, closed under it) raises."""
        hb = self._heartbeat
        if hb is not None:  # the heartbeat sees the same end of the hub: let it say what it was
            end = time.monotonic() + 0.5
            while hb.failure is None and not hb.hub_closed and time.monotonic() < end:
                time.sleep(0.01)
        known = self._known_failure(what)
        if known is not None:
            return known
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.hub_rank is None:
            return RuntimeError(f"rank {self.rank}: the launcher's hub closed during {what} ({why})")
        if self._heartbeat is not None and self._heartbeat.hub_closed:
            return RuntimeError(f"rank {self.rank}: {what}: rank {self.hub_rank} has ended and closed the launch's hub")
        return RankFailed(
            self.hub_rank, f"it serves the launch's hub, which rank {self.rank} cannot reach for {what} ({why})"
        )

    # -- the hub --

    def _call(self, header: dict[str, Any], what: str, payload: bytes = b"") -> bytes:
        known = self._known_failure(what)
        if known is not None:
            raise known
        timeout = hub_timeout_s()
        start = time.monotonic()
        hb = self._heartbeat
        try:
            link = wire.connect(
                self.hub_address,
                self.hub_key,
                min(wire.HANDSHAKE_TIMEOUT_S, timeout),
                track=None if hb is None else hb.track,  # a hub lost meanwhile ends the handshake too
            )
        except AuthenticationError as exc:
            raise RuntimeError(f"rank {self.rank}: the hub refused this rank's key ({exc})") from None
        except (OSError, EOFError) as exc:
            raise self._unreachable(what, exc) from None
        try:
            link.send(header, payload)
            while not link.conn.poll(_POLL_S):
                known = self._known_failure(what)
                if known is not None:
                    raise known
                if time.monotonic() - start > timeout:
                    raise TimeoutError(
                        f"rank {self.rank}: {what} did not complete within {timeout:g} s "
                        f"(${HUB_TIMEOUT_ENV}); a rank may be stuck or have left the launch"
                    )
            raw = link.conn.recv_bytes(wire.MAX_MESSAGE)
        except TimeoutError:  # the deadline above (an OSError too)
            raise
        except (EOFError, OSError) as exc:
            raise self._unreachable(what, exc) from None
        finally:
            if hb is not None:
                hb.untrack(link)
            link.close()
        try:
            reply, value = wire.parse_reply(raw)
        except wire.MalformedMessage as exc:
            raise RuntimeError(f"rank {self.rank}: {what}: the hub's reply is malformed ({exc})") from None
        if reply["status"] != "ok":
            message = reply.get("message", reply["status"])
            if "failed_rank" in reply:
                raise RankFailed(reply["failed_rank"], f"{message} (rank {self.rank}: {what})")
            raise RuntimeError(f"rank {self.rank}: {what} failed: {message}")
        return value

    def broadcast(self, value: bytes | None, *, key: str = "default", root: int = 0) -> bytes:
        """``root`` passes bytes, every rank gets them (e.g. an NVSHMEM unique id).

        Every rank calls broadcast with a key the same number of times, in the same order;
        the n-th call of a key is its own exchange, so a reused key never hands out old bytes.
        """
        if not isinstance(key, str):
            raise TypeError(f"broadcast: key must be a str, got {type(key).__name__}")
        root = arg_checks.integer("root", root)
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast: root must be a rank in [0, {self.world_size}), got {root!r}")
        self._uses[key] = n = self._uses.get(key, 0) + 1
        slot = f"{key}#{n}"
        if self.rank == root:
            if not isinstance(value, (bytes, bytearray)):
                raise TypeError(f"broadcast: rank {root} must pass bytes, got {type(value).__name__}")
            self._call({"op": "put", "key": slot}, f"broadcast {slot!r}", bytes(value))
            return bytes(value)
        return self._call({"op": "get", "key": slot, "root": root}, f"broadcast {slot!r} from rank {root}")

    def barrier(self) -> None:
        self._uses["<barrier>"] = n = self._uses.get("<barrier>", 0) + 1
        self._call({"op": "barrier", "gen": n, "rank": self.rank}, f"barrier #{n}")

    def allgather(self, value: bytes, *, key: str = "default") -> list[bytes]:
        """Every rank's bytes in rank order, through the launch's shared status board (no
        server round trip: a layer call across ranks makes one). Exchanges are numbered in
        call order, which every rank shares; ``key`` only names the exchange in errors."""
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"allgather: expected bytes, got {type(value).__name__}")
        if self._board is None:
            self._board = status_board.StatusBoard(board_path(self.hub_address), self.world_size)
        self._uses["<allgather>"] = n = self._uses.get("<allgather>", 0) + 1
        who = f"rank {self.rank}: exchange {key!r} #{n}"
        known = self._known_failure(who)
        if known is not None:
            raise known
        self._board.post(self.rank, n, frame(key, bytes(value), status_board.MAX_PAYLOAD))
        try:
            frames = self._board.gather(n, hub_timeout_s(), who)
        except status_board.RankGone as exc:
            if exc.how == status_board.ENDED:
                raise RuntimeError(str(exc)) from None
            failure = self.peer_failure()
            if isinstance(failure, RankFailed) and failure.rank == exc.rank:
                raise RankFailed(exc.rank, f"{failure.detail} ({who})") from None
            raise RankFailed(exc.rank, str(exc)) from None
        return unframe(key, frames, who)


_env_context: RankGroup | None = None


def launched() -> bool:
    """True in a process started by ``megamoe-rt launch`` (or spawn)."""
    return _ENV_RANK in os.environ and _ENV_HUB in os.environ


def context_from_env() -> RankGroup:
    """This process's rank context: a :class:`RankContext` in a process started by
    ``megamoe-rt launch`` (or spawn); an :class:`~megamoe_rt.ep.mpi_context.MpiRankContext`
    under ``mpirun``/``mpiexec`` or ``srun --mpi=pmix`` (NVSHMEM then bootstraps through MPI);
    for ``torchrun`` or a plain ``srun`` on one node, a :class:`RankContext` on a hub rank 0
    serves (megamoe_rt/ep/rendezvous.py). One per process: broadcast and barrier counts must
    agree across ranks. A :class:`RankContext` starts the rank's heartbeat."""
    global _env_context
    if _env_context is None:
        if launched():
            parent = os.environ.get(LAUNCHER_PID_ENV, "")
            parent_pid = int(parent) if parent.isdigit() else None
            if parent_pid is not None:
                liveness.die_with_parent(parent_pid)
            ctx = RankContext(
                int(os.environ[_ENV_RANK]),
                int(os.environ[_ENV_WORLD]),
                os.environ[_ENV_HUB],
                bytes.fromhex(os.environ[_ENV_KEY]),
            )
            ctx.start_heartbeat(parent_pid)
            _env_context = ctx
        else:
            from megamoe_rt.ep import rendezvous
            from megamoe_rt.ep.mpi_context import MpiRankContext, under_mpi

            torchrun = rendezvous.torchrun_ranks() if rendezvous.started_by_torchrun() else None
            if torchrun is not None:  # before MPI: an outer srun may pass PMI variables down
                _env_context = _meet_on_this_node(torchrun)
            elif under_mpi():
                _env_context = MpiRankContext()
            elif (ranks := rendezvous.launcher_ranks()) is not None:
                _env_context = _meet_on_this_node(ranks)
            else:
                raise RuntimeError(
                    f"not started by `megamoe-rt launch` ({_ENV_RANK} is not set), an MPI launcher, torchrun or srun"
                )
    return _env_context


_local_hub: Hub | None = None  # rank 0's hub for ranks started by torchrun or srun (lives with the process)


def _meet_on_this_node(ranks: Any) -> RankContext:
    """Ranks of torchrun or srun on one node: rank 0 serves the hub the launcher would
    (megamoe_rt/ep/rendezvous.py), the others find it through a private rendezvous file."""
    global _local_hub
    from megamoe_rt.ep import rendezvous

    rendezvous.check_single_node(ranks)
    rendezvous.prepare_rank_env(single_node=True)
    if ranks.rank == 0:
        hub = _local_hub = Hub(ranks.world_size)
        path = rendezvous.publish_hub(ranks.job, hub.address, hub.key)
        rendezvous.remove_at_exit(path, hub.close_when_idle)
        address, key = hub.address, hub.key
    else:
        address, key = rendezvous.find_hub(ranks.job, hub_timeout_s())
    device = rendezvous.visible_device(ranks.local_rank)
    ctx = RankContext(ranks.rank, ranks.world_size, address, key, device_ordinal=device, hub_rank=0)
    ctx.start_heartbeat()  # after rank 0's hub clean-up was registered: its goodbye runs first
    return ctx


# --- checks of the launchers' arguments ------------------------------------------------------


def _check_nprocs(nprocs: Any) -> int:
    try:
        n = arg_checks.integer("nprocs", nprocs)
    except TypeError as exc:
        raise ArgumentTypeError(str(exc)) from None
    if n < 1:  # the launchers' messages start with the argument's name
        raise ValueError(f"nprocs: expected an integer >= 1, got {n}")
    return n


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise ArgumentTypeError(f"timeout: expected a number of seconds or None, got {type(timeout).__name__}")
    seconds = float(timeout)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout: expected a positive number of seconds or None, got {timeout!r}")
    return seconds


def _check_strings(name: str, values: Any) -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{name}: expected a sequence of str, got {type(values).__name__}")
    bad = [v for v in values if not isinstance(v, str)]
    if bad:
        raise ArgumentTypeError(f"{name}: expected a sequence of str, got a {type(bad[0]).__name__} in it")
    return list(values)


# --- spawn(fn) -------------------------------------------------------------------------------


def _rank_main(fn, rank, world, address, key, args, results, parent_pid=None):
    os.environ.update(rank_env(dict(os.environ)))
    ctx = RankContext(rank, world, address, key)
    try:
        if parent_pid is not None:
            liveness.die_with_parent(parent_pid)
        ctx.start_heartbeat(parent_pid)
        out = fn(ctx, *args)
        pickle.dumps(out)  # a result the queue cannot carry is this rank's error, not a silent hang
        results.put((rank, "ok", out))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        ctx.leave()
        sys.exit(1)
    ctx.leave()


def _resume(pid: int) -> None:
    """A stopped process takes no signal but SIGKILL until it runs again."""
    try:
        os.kill(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: Sequence[Any]) -> None:
    """SIGTERM (and SIGCONT, for a stopped one), then SIGKILL after a grace period; wait for
    every process."""
    for p in procs:
        if p.is_alive():
            p.terminate()
            if p.pid is not None:
                _resume(p.pid)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        if p.pid is None:  # never started (its start failed): nothing to wait for
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def spawn(fn: Callable[..., Any], nprocs: int, *, args: Sequence[Any] = (), timeout: float | None = None) -> list:
    """Run ``fn(ctx, *args)`` in ``nprocs`` processes (one per GPU); return their results by rank.

    ``fn`` must be importable (defined at module level). The first failure stops every
    other rank and raises :class:`RankFailed` naming the rank that failed first: one that
    raised, or whose process died or stopped responding (not the ranks that then failed
    waiting for it).
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a function defined at module level, got {type(fn).__name__} {fn!r}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"fn: {fn!r} cannot be sent to the ranks; define it at module level ({exc})") from None
    nprocs = _check_nprocs(nprocs)
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args: expected a sequence of arguments for fn, got {type(args).__name__}")
    try:
        pickle.dumps(tuple(args))
    except Exception as exc:
        raise TypeError(f"args: cannot be sent to the ranks ({exc})") from None
    timeout = _check_timeout(timeout)
    ctx = mp.get_context("spawn")
    hub = Hub(nprocs)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, nprocs, hub.address, hub.key, tuple(args), results, os.getpid()))
        for r in range(nprocs)
    ]
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def drain(wait_s: float) -> None:
        end = time.monotonic() + wait_s
        while True:
            try:
                rank, status, value = results.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                return
            (out if status == "ok" else errors)[rank] = value

    def culprit_failed(r: int, hub_detail: str | None) -> RankFailed:
        """Rank ``r`` failed first: its own error, else how its process ended."""
        drain(0.2)  # its error may still be on its way
        if r in errors:
            return RankFailed(r, errors[r])
        procs[r].join(0.5)  # a dead process is reaped within moments
        code = procs[r].exitcode
        if code is not None:
            return RankFailed(r, f"process exited with status {code}{signal_note(code)} without a result")
        return RankFailed(r, hub_detail or "failed")

    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        while len(out) < nprocs:
            try:
                rank, status, value = results.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode == 0:
                        hub.rank_exited(r)
                first = hub.first_failure()
                if first is not None:  # a rank died or stopped responding
                    raise culprit_failed(*first) from None
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None:
                        time.sleep(0.2)  # a report may still be in flight
                        drain(0.0)
                        if r not in out:
                            raise culprit_failed(r, None) from None
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError(f"spawn: ranks still running after {timeout} s") from None
                continue
            if status == "error":
                errors[rank] = value
                first = hub.first_failure()
                # A rank that failed waiting for one that died is not the one to name.
                if first is not None and first[0] != rank:
                    raise culprit_failed(*first)
                raise RankFailed(rank, value)
            out[rank] = value
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))  # stragglers are stopped below
        return [out[r] for r in range(nprocs)]
    finally:
        try:
            _stop(procs)
        finally:
            hub.close()


# --- megamoe-rt launch -n N script.py ---------------------------------------------------------


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def _hub_failures(hub: Hub, procs: Sequence[subprocess.Popen], codes: list[int | None]) -> list[int]:
    """The ranks the hub declared dead or unresponsive, in that order, but for a rank whose
    process ended with status 0 (``os._exit(0)`` skips the goodbye, it is no failure).
    ``codes`` takes the statuses it waited for."""
    stalled = hub.stalled()
    out = []
    for r in hub.failures():
        if codes[r] is None and r not in stalled:
            try:
                codes[r] = procs[r].wait(0.5)  # a dead process is reaped within moments
            except subprocess.TimeoutExpired:
                pass
        if codes[r] != 0:
            out.append(r)
    return out


def _first_failure(
    hub: Hub, hub_failed: list[int], codes: list[int | None], seen: dict[int, float]
) -> tuple[int, str, int]:
    """``(rank, what happened, exit status to use)`` for the rank that failed first: the one the
    hub declared dead or unresponsive, else the first whose process ended with an error (as
    the launcher saw them end, ties in the order the hub saw them leave)."""
    if hub_failed:
        r = hub_failed[0]
        detail = hub.failures()[r]
        c = codes[r]
        if c is not None:
            return r, f"exited with status {c}{signal_note(c)}", c if c > 0 else 128 - c
        return r, detail, 1
    order = hub.left_order()
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    r = min(failed, key=lambda r: (seen.get(r, math.inf), order.index(r) if r in order else len(order), r))
    c = codes[r]
    assert c is not None
    return r, f"exited with status {c}{signal_note(c)}", c if c > 0 else 128 - c


def launch_script(
    nprocs: int,
    script: str,
    script_args: Sequence[str],
    *,
    timeout: float | None = None,
    module: bool = False,
    devices: str | None = None,
) -> int:
    """Run ``python script args`` (``python -m script args`` with ``module``) as ``nprocs`` ranks;
    returns the exit status to use. ``devices``: the ranks' GPUs as ``$MEGAMOE_RT_RANK_DEVICES``
    takes them (one ordinal per rank, or one for all; see megamoe_rt/ep/env.py).

    A rank that fails (exits with an error, dies, or stops responding to its heartbeat) is
    named on stderr, the others get a moment to end on their own and are then stopped. The
    ranks die with the launcher (Linux: they get SIGKILL when it dies)."""
    nprocs = _check_nprocs(nprocs)
    timeout = _check_timeout(timeout)
    if not isinstance(script, str):
        raise ArgumentTypeError(f"script: expected a str, got {type(script).__name__}")
    script_args = _check_strings("script_args", script_args)
    if not isinstance(module, bool):
        raise ArgumentTypeError(f"module: expected a bool, got {type(module).__name__}")
    if devices is not None and not isinstance(devices, str):
        raise ArgumentTypeError(f"devices: expected a str or None, got {type(devices).__name__}")
    base = dict(os.environ)
    if devices is not None:
        base[RANK_DEVICES_ENV] = devices
        listed = len(devices.split(","))
        if listed not in (1, nprocs):
            raise ValueError(f"devices: {devices!r} names {listed} GPUs; expected one, or one per rank ({nprocs})")
        assigned_device(0, base)  # a malformed list is refused before any rank starts
    liveness.heartbeat_timeout_s()  # a malformed $MEGAMOE_RT_HEARTBEAT_TIMEOUT_S, before any rank starts
    # SIGTERM / SIGHUP to the launcher must still run the clean-up below (no orphans), for the
    # launch only: the caller's handlers come back after it. Signal handlers belong to the main
    # thread; from another thread the ranks still die with the launcher's process.
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _exit_on_signal)
    hub = Hub(nprocs)
    procs: list[subprocess.Popen] = []
    preexec = liveness.preexec_die_with_parent()
    try:
        for r in range(nprocs):
            env = rank_env(base)
            env.update({_ENV_RANK: str(r), _ENV_WORLD: str(nprocs), _ENV_HUB: hub.address, _ENV_KEY: hub.key.hex()})
            env[LAUNCH_REPORT_ENV] = report_path(hub.address)
            env[LAUNCHER_PID_ENV] = str(os.getpid())
            target = ["-m", script] if module else [script]
            procs.append(subprocess.Popen([sys.executable, *target, *script_args], env=env, preexec_fn=preexec))
        start = time.monotonic()
        seen: dict[int, float] = {}  # when the launcher saw each rank end
        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            for r, c in enumerate(codes):
                if c is not None:
                    seen.setdefault(r, now)
            if any(c not in (None, 0) for c in codes) or _hub_failures(hub, procs, codes):
                # The others were told at the hub (if they wait there): let them end and say so.
                end = time.monotonic() + _REPORT_GRACE_S
                while time.monotonic() < end:
                    stalled = hub.stalled()  # a stopped rank does not end on its own
                    if all(p.poll() is not None for r, p in enumerate(procs) if r not in stalled):
                        break
                    time.sleep(0.05)
                codes = [p.poll() for p in procs]
                now = time.monotonic()
                for r, c in enumerate(codes):
                    if c is not None:
                        seen.setdefault(r, now)
                r, what, status = _first_failure(hub, _hub_failures(hub, procs, codes), codes, seen)
                # A rank that cannot run at all said why in one line, for every rank alike.
                missing = read_launch_report(report_path(hub.address))
                if missing is not None:
                    print(missing, file=sys.stderr)
                else:
                    print(f"megamoe-rt launch: rank {r} {what}; stopping the other ranks", file=sys.stderr)
                return status
            if all(c == 0 for c in codes):
                return 0
            for r, code in enumerate(codes):
                if code == 0:
                    hub.rank_exited(r)  # the others may not wait for it at the hub any more
            if timeout is not None and time.monotonic() - start > timeout:
                print(f"megamoe-rt launch: ranks still running after {timeout} s; stopping them", file=sys.stderr)
                return 124
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                _resume(p.pid)
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        hub.close()
        for signum, handler in previous.items():  # None: one set outside Python, taken as the default
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
