"""Ranks started by launchers users already have: ``torchrun`` and Slurm's ``srun``.

Across nodes both go through MPI (NVSHMEM then bootstraps over MPI):
``srun --mpi=pmix`` sets the PMI variables :func:`megamoe_rt.ep.mpi_context.under_mpi` looks
for. Multi-node ``torchrun`` starts no MPI, so it is refused with that advice.

On one node the ranks meet the way ``megamoe-rt launch`` ranks do: through a hub on a local
socket and a shared status board (megamoe_rt/ep/launch.py). Rank 0 starts the hub in its own
process and writes the hub's address and key into a rendezvous file; the other ranks wait for
that file. The file lies in a private directory (``0700``, owned by the user, refused
otherwise). Its name carries the launcher's job and restart (torchrun: run id, master address
and port; srun: job and step id). A file an earlier launch of the same name left behind
names a hub that is gone, so the other ranks wait until rank 0 has replaced it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import stat
import tempfile
import threading
import time
from dataclasses import dataclass

from megamoe_rt.ep.env import LOCAL_BOOTSTRAP_ENV, SAFE_ENV, assigned_device
from megamoe_rt.runtime.file_trust import untrusted_reason

RENDEZVOUS_DIR_ENV = "MEGAMOE_RT_RENDEZVOUS_DIR"


@dataclass(frozen=True)
class LauncherRanks:
    """What a launcher's environment says about this process."""

    launcher: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    job: str  # names the launch (with the parent process id, see the module docstring)


def _int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise RuntimeError(f"${name}={env[name]!r}: expected an integer") from None


def torchrun_ranks(env: dict[str, str] | None = None) -> LauncherRanks | None:
    """The ranks a torchrun-style launcher describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``), or None."""
    env = dict(os.environ) if env is None else env
    if not all(n in env for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return None
    job = "torchrun-{}-{}-{}-{}".format(
        env.get("TORCHELASTIC_RUN_ID", "none"),
        env.get("MASTER_ADDR", ""),
        env.get("MASTER_PORT", "0"),
        env.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    return LauncherRanks(
        "torchrun",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK"),
        _int(env, "LOCAL_WORLD_SIZE"),
        job,
    )


def started_by_torchrun(env: dict[str, str] | None = None) -> bool:
    """torchrun's own markers: they win over MPI variables an outer ``srun`` passed down."""
    env = dict(os.environ) if env is None else env
    return torchrun_ranks(env) is not None and ("TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env)


def slurm_ranks(env: dict[str, str] | None = None) -> LauncherRanks | None:
    """The ranks of an ``srun`` step (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
    ``SLURM_LOCALID``, ``SLURM_STEP_NUM_NODES``), or None; a batch script, which has the
    allocation's variables but no step's, is not one."""
    env = dict(os.environ) if env is None else env
    if not all(n in env for n in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")):
        return None
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    nodes = _int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else 1
    job = "slurm-{}-{}-{}".format(
        env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0"), env.get("SLURM_RESTART_COUNT", "0")
    )
    return LauncherRanks(
        "slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID"), world if nodes == 1 else -1, job
    )


def launcher_ranks(env: dict[str, str] | None = None) -> LauncherRanks | None:
    """The ranks torchrun or an ``srun`` step describe, or None when neither started this
    process."""
    env = dict(os.environ) if env is None else env
    return torchrun_ranks(env) or slurm_ranks(env)


def check_single_node(ranks: LauncherRanks) -> None:
    """Refuse, with the way out, launches the local rendezvous cannot serve."""
    # A multi-node srun step has no local world size (-1): every task gets the multi-node hint
    # below, whatever its local rank, not a complaint about the rank.
    local_limit = ranks.world_size if ranks.local_world_size < 0 else max(ranks.local_world_size, 1)
    if not 0 <= ranks.rank < ranks.world_size or not 0 <= ranks.local_rank < local_limit:
        raise RuntimeError(
            f"{ranks.launcher}: rank {ranks.rank} of {ranks.world_size} (local {ranks.local_rank}) is not a valid rank"
        )
    if ranks.local_world_size != ranks.world_size:
        hint = (
            "start the job with `srun --mpi=pmix` (or pmi2) so that its ranks run under MPI"
            if ranks.launcher == "slurm"
            else "start the ranks with mpirun or `srun --mpi=pmix` instead"
        )
        raise RuntimeError(
            f"{ranks.launcher}: {ranks.world_size} ranks span more than one node; across nodes megamoe_rt's ranks "
            f"meet over MPI (NVSHMEM bootstraps over MPI too): {hint} (docs/ARCHITECTURE.md, 'Launchers')"
        )


def visible_device(local_rank: int, env: dict[str, str] | None = None) -> int:
    """The rank's GPU ordinal: its local rank, or 0 when the launcher gave each rank one GPU
    (``CUDA_VISIBLE_DEVICES`` naming a single device, as ``srun --gpus-per-task=1`` does);
    ``$MEGAMOE_RT_RANK_DEVICES`` overrides both."""
    env = dict(os.environ) if env is None else env
    assigned = assigned_device(local_rank, env)
    if assigned is not None:
        return assigned
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return 0 if len(visible) == 1 else local_rank


def private_dir() -> str:
    """A directory only this user can enter: ``$MEGAMOE_RT_RENDEZVOUS_DIR`` or one under the
    system's temporary directory, created ``0700``; one owned by someone else, or open to
    group or others, is refused (another user could plant a hub there)."""
    path = os.environ.get(RENDEZVOUS_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"megamoe-rt-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    reason = f"{path} is not a directory" if not stat.S_ISDIR(st.st_mode) else untrusted_reason(st, path, private=True)
    if reason is not None:
        raise RuntimeError(
            f"rendezvous directory: {reason}; it must be this user's, mode 0700: "
            f"remove it or set ${RENDEZVOUS_DIR_ENV} to a private directory"
        )
    return path


def _file_name(job: str) -> str:
    return "rdzv-" + re.sub(r"[^A-Za-z0-9_.-]", "_", job) + ".json"


def publish_hub(job: str, address: str, key: bytes) -> str:
    """Rank 0: write the hub's address and key for the other local ranks (atomically, 0600)."""
    path = os.path.join(private_dir(), _file_name(job))
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "key": key.hex()}, f)
    os.replace(tmp, path)
    return path


def find_hub(job: str, timeout_s: float) -> tuple[str, bytes]:
    """Other ranks: wait for rank 0's rendezvous file and a hub that answers at its address.
    A file left by an earlier launch of the same name (its process killed before it could
    remove it) names a hub that is gone: it is read again until rank 0 has replaced it."""
    from megamoe_rt.ep import wire

    path = os.path.join(private_dir(), _file_name(job))
    deadline = time.monotonic() + timeout_s
    seen = "no file"
    while time.monotonic() < deadline:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            time.sleep(0.05)
            continue
        with os.fdopen(fd) as f:
            reason = untrusted_reason(os.fstat(f.fileno()), f"rendezvous file {path}", private=True)
            if reason is not None:
                raise RuntimeError(f"{reason}; refused")
            try:
                data = json.load(f)
                address, key = str(data["address"]), bytes.fromhex(data["key"])
            except (ValueError, KeyError, TypeError):
                seen = "a file that is not a rendezvous record"
                time.sleep(0.05)
                continue
        try:
            # Bounded by what is left of the deadline: a listener that accepts and never answers
            # (rank 0 stopped) must not hold this rank past it.
            remaining = max(0.05, deadline - time.monotonic())
            wire.connect(address, key, min(wire.HANDSHAKE_TIMEOUT_S, remaining)).close()
        except (OSError, EOFError) as exc:  # the hub of a launch that is gone
            seen = f"a hub that does not answer ({type(exc).__name__})"
            time.sleep(0.05)
            continue
        return address, key
    raise TimeoutError(
        f"rank 0's rendezvous file {path} did not name a live hub within {timeout_s:g} s (last seen: {seen}); "
        "did rank 0 fail before creating its context?"
    )


def prepare_rank_env(single_node: bool) -> None:
    """What every rank process runs with (megamoe_rt/ep/env.py), set in-process before NVSHMEM
    or NCCL read it: multicast off; on one node the bootstrap listens on loopback."""
    if single_node:
        for name, value in LOCAL_BOOTSTRAP_ENV.items():
            os.environ.setdefault(name, value)
    os.environ.update(SAFE_ENV)


def remove_at_exit(path: str, close) -> None:
    """Rank 0: close the hub and remove the rendezvous file when the process ends, also when it
    ends by SIGTERM (how torchrun and srun stop their workers), which would skip ``atexit``:
    where SIGTERM still has its default action, it becomes ``SystemExit(143)``."""

    def done() -> None:
        try:
            close()
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    atexit.register(done)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
