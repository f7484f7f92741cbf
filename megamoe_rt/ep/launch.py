"""One process per GPU: ``spawn(fn, nprocs)`` and ``megamoe-rt launch -n N script.py``.

Ranks bootstrap through a small hub the launcher runs on a local socket (no MPI): rank 0
can broadcast bytes (an NVSHMEM unique id) to the others, and all can meet at a barrier.
NVLink multicast stays off in every rank (``NVSHMEM_DISABLE_NVLS=1``,
``NCCL_NVLS_ENABLE=0``). When a rank raises or dies, the launcher stops the others and
reports the failing rank's error; no process is left behind.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener
from typing import Any

from megamoe_rt.ep import board as status_board
from megamoe_rt.ep.env import LAUNCH_REPORT_ENV, RANK_DEVICES_ENV, assigned_device, rank_env, read_launch_report
from megamoe_rt.ep.group import RankGroup, frame, unframe
from megamoe_rt.runtime.deadlines import env_seconds

_ENV_RANK, _ENV_WORLD, _ENV_HUB, _ENV_KEY = (
    "MEGAMOE_RT_RANK",
    "MEGAMOE_RT_WORLD_SIZE",
    "MEGAMOE_RT_HUB",
    "MEGAMOE_RT_HUB_KEY",
)
_GRACE_S = 5.0
# How long a rank waits at the hub (a broadcast's value, a barrier's other ranks) before it
# gives up naming the exchange. Generous: a peer may be compiling kernels on a cold cache.
HUB_TIMEOUT_ENV = "MEGAMOE_RT_HUB_TIMEOUT_S"
DEFAULT_HUB_TIMEOUT_S = 600.0


def hub_timeout_s() -> float:
    return env_seconds(HUB_TIMEOUT_ENV, DEFAULT_HUB_TIMEOUT_S)


class RankFailed(RuntimeError):
    """A rank raised or exited with a non-zero status; the other ranks were stopped."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed: {detail}")


# --- the hub ---------------------------------------------------------------------------------


def _reply(conn: Any, msg: tuple) -> None:
    """Send to a rank that may have stopped listening (its call timed out, its process ended):
    that rank's problem, never the hub's (its other clients still need their replies)."""
    try:
        conn.send(msg)
    except (OSError, EOFError, ValueError):
        pass


class _Hub:
    """Serves broadcasts (by key, from rank 0) and barriers to the ranks of one launch.

    Every reply is ``("ok", value)`` or ``("error", message)``. The launcher tells the hub when
    a rank has ended (:meth:`rank_exited`): an exchange that rank can no longer join fails at
    once for the ranks waiting in it, instead of leaving them waiting.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.key = secrets.token_bytes(16)
        self._dir = tempfile.mkdtemp(prefix="megamoe-rt-")
        self.address = os.path.join(self._dir, "hub.sock")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        status_board.create(board_path(self.address), world_size)
        self._board = status_board.StatusBoard(board_path(self.address), world_size)
        self._values: dict[str, bytes] = {}
        self._waiting: dict[str, list] = {}
        self._barriers: dict[int, list] = {}
        self._exited: set[int] = set()
        self._open = 0  # client connections being served
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue  # one failed connection: keep serving the ranks
            except Exception:
                # A failed handshake (wrong key, a stray connection closing early) is that
                # client's problem; the ranks of the launch still have to get in.
                continue
            with self._lock:
                self._open += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        try:
            self._serve_requests(conn)
        finally:
            with self._lock:
                self._open -= 1

    def _serve_requests(self, conn) -> None:
        try:
            while True:
                msg = conn.recv()
                op = msg[0]
                with self._lock:
                    if op == "put":
                        _, key, value = msg
                        self._values[key] = value
                        for c, _ in self._waiting.pop(key, []):
                            _reply(c, ("ok", value))
                        _reply(conn, ("ok", True))
                    elif op == "get":
                        key, root = msg[1], msg[2]
                        if key in self._values:
                            _reply(conn, ("ok", self._values[key]))
                        elif root in self._exited:
                            _reply(conn, ("error", self._gone(root, f"broadcast {key!r}")))
                        else:
                            self._waiting.setdefault(key, []).append((conn, root))
                    elif op == "barrier":
                        gen = msg[1]
                        group = self._barriers.setdefault(gen, [])
                        group.append((conn, msg[2]))
                        missing = set(range(self.world_size)) - {r for _, r in group}
                        if not missing:
                            for c, _ in self._barriers.pop(gen):
                                _reply(c, ("ok", True))
                        elif missing & self._exited:
                            self._fail_barrier(gen, min(missing & self._exited))
        except (EOFError, OSError):
            return

    def _gone(self, rank: int, what: str) -> str:
        return f"rank {rank} exited without joining {what}"

    def _fail_barrier(self, gen: int, rank: int) -> None:
        for c, _ in self._barriers.pop(gen, []):
            _reply(c, ("error", self._gone(rank, f"barrier #{gen}")))

    def rank_exited(self, rank: int) -> None:
        """``rank`` has ended: fail what it can no longer join."""
        self._board.mark_gone(rank)
        with self._lock:
            self._exited.add(rank)
            for gen, group in list(self._barriers.items()):
                if rank not in {r for _, r in group}:
                    self._fail_barrier(gen, rank)
            for key, waiters in list(self._waiting.items()):
                stuck = [(c, root) for c, root in waiters if root == rank]
                for c, _ in stuck:
                    _reply(c, ("error", self._gone(rank, f"broadcast {key!r}")))
                self._waiting[key] = [w for w in waiters if w[1] != rank]

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
        self._closed = True
        self._board.close()
        try:
            self._listener.close()
        finally:
            for path in (self.address, board_path(self.address), report_path(self.address)):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            os.rmdir(self._dir)


def board_path(hub_address: str) -> str:
    """The launch's status board (megamoe_rt/ep/board.py), next to the hub's socket."""
    return os.path.join(os.path.dirname(hub_address), "board")


def report_path(hub_address: str) -> str:
    """Where a rank leaves the line saying what it lacks to run (megamoe_rt/ep/env.py)."""
    return os.path.join(os.path.dirname(hub_address), "report")


# --- what a rank sees ------------------------------------------------------------------------


@dataclass
class RankContext:
    """A rank started by ``megamoe-rt launch`` or :func:`spawn` (a :class:`RankGroup`)."""

    rank: int
    world_size: int
    hub_address: str
    hub_key: bytes
    device_ordinal: int | None = None  # None: the rank (ranks map onto the visible devices in order)
    _uses: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _board: status_board.StatusBoard | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def device(self) -> int:
        """This rank's GPU ordinal: ranks map onto the visible devices in order, unless the
        launcher gave each rank its own (``device_ordinal``) or ``$MEGAMOE_RT_RANK_DEVICES``
        assigns them (megamoe_rt/ep/env.py)."""
        if self.device_ordinal is not None:
            return self.device_ordinal
        assigned = assigned_device(self.rank)
        return self.rank if assigned is None else assigned

    def _call(self, msg, what: str):
        timeout = hub_timeout_s()
        conn = Client(self.hub_address, family="AF_UNIX", authkey=self.hub_key)
        try:
            conn.send(msg)
            if not conn.poll(timeout):
                raise TimeoutError(
                    f"rank {self.rank}: {what} did not complete within {timeout:g} s "
                    f"(${HUB_TIMEOUT_ENV}); a rank may be stuck or have left the launch"
                )
            status, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"rank {self.rank}: the launcher's hub closed during {what}") from None
        finally:
            conn.close()
        if status != "ok":
            raise RuntimeError(f"rank {self.rank}: {what} failed: {value}")
        return value

    def broadcast(self, value: bytes | None, *, key: str = "default", root: int = 0) -> bytes:
        """``root`` passes bytes, every rank gets them (e.g. an NVSHMEM unique id).

        Every rank calls broadcast with a key the same number of times, in the same order;
        the n-th call of a key is its own exchange, so a reused key never hands out old bytes.
        """
        self._uses[key] = n = self._uses.get(key, 0) + 1
        slot = f"{key}#{n}"
        if self.rank == root:
            if not isinstance(value, (bytes, bytearray)):
                raise TypeError(f"broadcast: rank {root} must pass bytes, got {type(value).__name__}")
            self._call(("put", slot, bytes(value)), f"broadcast {slot!r}")
            return bytes(value)
        return self._call(("get", slot, root), f"broadcast {slot!r} from rank {root}")

    def barrier(self) -> None:
        self._uses["<barrier>"] = n = self._uses.get("<barrier>", 0) + 1
        self._call(("barrier", n, self.rank), f"barrier #{n}")

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
        self._board.post(self.rank, n, frame(key, bytes(value), status_board.MAX_PAYLOAD))
        try:
            frames = self._board.gather(n, hub_timeout_s(), who)
        except status_board.RankGone as exc:
            raise RuntimeError(str(exc)) from None
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
    agree across ranks."""
    global _env_context
    if _env_context is None:
        if launched():
            _env_context = RankContext(
                int(os.environ[_ENV_RANK]),
                int(os.environ[_ENV_WORLD]),
                os.environ[_ENV_HUB],
                bytes.fromhex(os.environ[_ENV_KEY]),
            )
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


_local_hub: _Hub | None = None  # rank 0's hub for ranks started by torchrun or srun (lives with the process)


def _meet_on_this_node(ranks: Any) -> RankContext:
    """Ranks of torchrun or srun on one node: rank 0 serves the hub the launcher would
    (megamoe_rt/ep/rendezvous.py), the others find it through a private rendezvous file."""
    global _local_hub
    from megamoe_rt.ep import rendezvous

    rendezvous.check_single_node(ranks)
    rendezvous.prepare_rank_env(single_node=True)
    if ranks.rank == 0:
        hub = _local_hub = _Hub(ranks.world_size)
        path = rendezvous.publish_hub(ranks.job, hub.address, hub.key)
        rendezvous.remove_at_exit(path, hub.close_when_idle)
        address, key = hub.address, hub.key
    else:
        address, key = rendezvous.find_hub(ranks.job, hub_timeout_s())
    device = rendezvous.visible_device(ranks.local_rank)
    return RankContext(ranks.rank, ranks.world_size, address, key, device_ordinal=device)


# --- spawn(fn) -------------------------------------------------------------------------------


def _rank_main(fn, rank, world, address, key, args, results):
    os.environ.update(rank_env(dict(os.environ)))
    ctx = RankContext(rank, world, address, key)
    try:
        out = fn(ctx, *args)
        pickle.dumps(out)  # a result the queue cannot carry is this rank's error, not a silent hang
        results.put((rank, "ok", out))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        sys.exit(1)


def _stop(procs: Sequence[Any]) -> None:
    """SIGTERM, then SIGKILL after a grace period; wait for every process."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def spawn(fn: Callable[..., Any], nprocs: int, *, args: Sequence[Any] = (), timeout: float | None = None) -> list:
    """Run ``fn(ctx, *args)`` in ``nprocs`` processes (one per GPU); return their results by rank.

    ``fn`` must be importable (defined at module level). The first failure stops every
    other rank and raises :class:`RankFailed` with that rank's error.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs: expected >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    hub = _Hub(nprocs)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, nprocs, hub.address, hub.key, tuple(args), results))
        for r in range(nprocs)
    ]
    out: dict[int, Any] = {}
    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        while len(out) < nprocs:
            try:
                rank, status, value = results.get(timeout=0.1)
            except Exception:  # queue.Empty: look for ranks that ended without reporting
                for r, p in enumerate(procs):
                    if p.exitcode is not None:
                        hub.rank_exited(r)
                    if r not in out and p.exitcode is not None:
                        time.sleep(0.2)  # a report may still be in flight
                        if results.empty():
                            raise RankFailed(r, f"process exited with status {p.exitcode} without a result") from None
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError(f"spawn: ranks still running after {timeout} s") from None
                continue
            if status == "error":
                raise RankFailed(rank, value)
            out[rank] = value
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))  # stragglers are stopped below
        return [out[r] for r in range(nprocs)]
    finally:
        _stop(procs)
        hub.close()


# --- megamoe-rt launch -n N script.py ---------------------------------------------------------


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


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
    takes them (one ordinal per rank, or one for all; see megamoe_rt/ep/env.py)."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs: expected an integer >= 1, got {nprocs!r}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout: expected a positive number of seconds or None, got {timeout!r}")
    base = dict(os.environ)
    if devices is not None:
        base[RANK_DEVICES_ENV] = devices
        listed = len(devices.split(","))
        if listed not in (1, nprocs):
            raise ValueError(f"devices: {devices!r} names {listed} GPUs; expected one, or one per rank ({nprocs})")
        assigned_device(0, base)  # a malformed list is refused before any rank starts
    # SIGTERM / SIGHUP to the launcher must still run the clean-up below (no orphans).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    hub = _Hub(nprocs)
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nprocs):
            env = rank_env(base)
            env.update({_ENV_RANK: str(r), _ENV_WORLD: str(nprocs), _ENV_HUB: hub.address, _ENV_KEY: hub.key.hex()})
            env[LAUNCH_REPORT_ENV] = report_path(hub.address)
            target = ["-m", script] if module else [script]
            procs.append(subprocess.Popen([sys.executable, *target, *script_args], env=env))
        start = time.monotonic()
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                # A rank that cannot run at all said why in one line, for every rank alike.
                missing = read_launch_report(report_path(hub.address))
                if missing is not None:
                    print(missing, file=sys.stderr)
                else:
                    print(
                        f"megamoe-rt launch: rank {r} exited with status {c}; stopping the other ranks", file=sys.stderr
                    )
                return c if c > 0 else 128 - c
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
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        hub.close()
