"""Environment every rank process runs with, whoever started it.

NVLink multicast stays off (NVSHMEM, NCCL and PyTorch's symmetric memory): the layer never
uses it, and a multicast object left behind by a crashed process can take a shared host's
GPUs out of service.
"""

from __future__ import annotations

import os

SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# Ranks started by `megamoe-rt launch` / spawn all run on this host: NVSHMEM's unique-id
# bootstrap listens on the loopback interface instead of the first network interface, so
# nothing off the host can reach (or disturb) it. A value the caller sets wins; multi-node
# runs (mpirun, NVSHMEM's MPI bootstrap) do not use it. See docs/ARCHITECTURE.md.
LOCAL_BOOTSTRAP_ENV = {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}


def rank_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of a locally launched rank: ``base`` with :data:`SAFE_ENV` forced and
    :data:`LOCAL_BOOTSTRAP_ENV` as defaults."""
    env = {**LOCAL_BOOTSTRAP_ENV, **base}
    env.update(SAFE_ENV)
    return env


# Which GPU each locally started rank uses, when not its local rank: a comma list with one
# ordinal per rank ("0,0" puts two ranks on GPU 0), or one ordinal for every rank. Ranks that
# share a GPU time-share it (without MPS their kernels take turns): the cross-rank paths are
# exercised exactly as across GPUs, so the multi-GPU tests run on one GPU, but the timings
# mean nothing. See docs/ARCHITECTURE.md, "Launchers".
RANK_DEVICES_ENV = "MEGAMOE_RT_RANK_DEVICES"


def assigned_device(rank: int, env: dict[str, str] | None = None) -> int | None:
    """The GPU ordinal ``$MEGAMOE_RT_RANK_DEVICES`` gives ``rank``, or None when it is unset."""
    text = (os.environ if env is None else env).get(RANK_DEVICES_ENV, "").strip()
    if not text:
        return None
    try:
        ordinals = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"${RANK_DEVICES_ENV}={text!r}: expected GPU ordinals separated by commas") from None
    if any(o < 0 for o in ordinals):
        raise ValueError(f"${RANK_DEVICES_ENV}={text!r}: GPU ordinals must be >= 0")
    if len(ordinals) == 1:
        return ordinals[0]
    if not 0 <= rank < len(ordinals):
        raise ValueError(f"${RANK_DEVICES_ENV}={text!r} names {len(ordinals)} GPUs; rank {rank} has none")
    return ordinals[rank]


# Where a rank of `megamoe-rt launch` leaves the one line saying why it cannot run (the GPU
# stack or a GPU missing: megamoe_rt/requirements.py) instead of printing it: every rank would
# print the same line, and the launcher prints it once in their stead.
LAUNCH_REPORT_ENV = "MEGAMOE_RT_LAUNCH_REPORT"


def leave_launch_report(line: str) -> bool:
    """Leave ``line`` for the launcher; False outside a launch (the caller prints it). The first
    rank's line stays: the others' say the same."""
    path = os.environ.get(LAUNCH_REPORT_ENV)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return True
    except OSError:  # the launcher's directory is gone: say it here instead
        return False
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return True


def read_launch_report(path: str) -> str | None:
    """The line a rank left at ``path``, or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None
