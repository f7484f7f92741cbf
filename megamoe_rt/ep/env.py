"""Environment every rank process runs with, whoever started it.

NVLink multicast stays off (NVSHMEM, NCCL and PyTorch's symmetric memory): the layer never
uses it, and a multicast object left behind by a crashed process can take a shared host's
GPUs out of service.
"""

from __future__ import annotations

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
