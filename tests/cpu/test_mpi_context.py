"""Ranks from mpirun/mpiexec: the MPI rank context and how a process picks its context (CPU)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from megamoe_rt.ep import launch
from megamoe_rt.ep.env import SAFE_ENV
from megamoe_rt.ep.mpi_context import MPI_ENV_MARKERS, MpiRankContext, under_mpi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _FakeComm:
    """Rank `rank` of `size` on hosts `hosts`; a broadcast hands out what rank `root` passed."""

    def __init__(self, rank, hosts, root_values):
        self.rank, self.hosts = rank, hosts
        self.root_values, self.barriers = root_values, 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.hosts)

    def allgather(self, value):
        assert value == socket.gethostname()
        return list(self.hosts)

    def bcast(self, value, root):
        if self.rank == root:
            self.root_values.append(value)
            return value
        return self.root_values[-1]

    def Barrier(self):
        self.barriers += 1


def test_rank_device_broadcast_and_barrier(monkeypatch):
    for name in SAFE_ENV:
        monkeypatch.delenv(name, raising=False)
    sent = []
    me = socket.gethostname()
    hosts = ["a", "a", me, "a", me, me, "b", me]  # rank 5 is the third rank on its host
    ctx = MpiRankContext(_FakeComm(rank=5, hosts=hosts, root_values=sent))
    assert (ctx.rank, ctx.world_size, ctx.device) == (5, 8, 2)
    assert all(os.environ[k] == v for k, v in SAFE_ENV.items())
    assert ctx.broadcast(bytearray(b"uid"), root=5) == b"uid" and sent == [b"uid"]
    assert ctx.broadcast(None, root=0) == b"uid"
    with pytest.raises(TypeError, match="rank 5 must pass bytes, got str"):
        ctx.broadcast("uid", root=5)
    ctx.barrier()
    assert ctx.mpi_comm.barriers == 1


def test_both_rank_contexts_are_rank_groups():
    from megamoe_rt.ep.group import MpiRankGroup, RankGroup

    me = socket.gethostname()
    mpi = MpiRankContext(_FakeComm(rank=0, hosts=[me], root_values=[]))
    local = launch.RankContext(0, 1, "/nonexistent/hub.sock", b"k")
    assert isinstance(mpi, RankGroup) and isinstance(mpi, MpiRankGroup)
    assert isinstance(local, RankGroup) and not isinstance(local, MpiRankGroup)

    class NoBarrier:
        rank, world_size, device = 0, 1, 0

        def broadcast(self, value, *, key="default", root=0):
            return value

    assert not isinstance(NoBarrier(), RankGroup)


def test_context_from_env_needs_a_launcher(monkeypatch):
    monkeypatch.setattr(launch, "_env_context", None)
    for name in (*MPI_ENV_MARKERS, "MEGAMOE_RT_RANK", "MEGAMOE_RT_HUB", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert not under_mpi()
    with pytest.raises(RuntimeError, match="an MPI launcher, torchrun or srun"):
        launch.context_from_env()
    monkeypatch.setenv("PMI_SIZE", "2")
    assert under_mpi()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec and mpi4py")
def test_ranks_under_mpiexec(tmp_path):
    pytest.importorskip("mpi4py")
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent("""
        from megamoe_rt.ep.launch import context_from_env
        from megamoe_rt.ep.mpi_context import MpiRankContext
        ctx = context_from_env()
        assert isinstance(ctx, MpiRankContext) and context_from_env() is ctx
        got = ctx.broadcast(b"from-1" if ctx.rank == 1 else None, root=1)
        ctx.barrier()
        with open(f"{OUT}/rank{ctx.rank}.txt", "w") as f:  # stdout of ranks may interleave
            f.write(f"rank {ctx.rank}/{ctx.world_size} device {ctx.device} got {got.decode()}")
    """).replace("{OUT}", str(tmp_path))
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("MEGAMOE_RT_RANK", "MEGAMOE_RT_HUB"):
        env.pop(name, None)
    out = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)]
    assert got == [f"rank {r}/3 device {r} got from-1" for r in range(3)]
