"""Ranks started by torchrun or srun: what their environments say, the single-node
rendezvous through a private file, and the refusals (multi-node without MPI, directories or
files another user could have planted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from megamoe_rt.ep import rendezvous as rdzv

MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
LAUNCH_VARS = ("MEGAMOE_RT_RANK", "MEGAMOE_RT_HUB")


def _torchrun(rank, world, local_world=None, **extra):
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world),
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RUN_ID": "job-a",
        **extra,
    }


def _slurm(rank, world, nodes=1, **extra):
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        **extra,
    }


def test_the_launchers_environments_are_read():
    t = rdzv.launcher_ranks(_torchrun(1, 4))
    assert (t.launcher, t.rank, t.world_size, t.local_rank, t.local_world_size) == ("torchrun", 1, 4, 1, 4)
    s = rdzv.launcher_ranks(_slurm(2, 3))
    assert (s.launcher, s.rank, s.world_size, s.local_rank, s.local_world_size) == ("slurm", 2, 3, 2, 3)
    assert rdzv.launcher_ranks({"PATH": "/bin"}) is None
    batch = {k: v for k, v in _slurm(0, 8).items() if not k.startswith("SLURM_STEP")}
    assert rdzv.launcher_ranks(batch) is None  # an sbatch script is no srun step
    assert not rdzv.started_by_torchrun({k: v for k, v in _torchrun(0, 2).items() if k != "TORCHELASTIC_RUN_ID"})
    assert rdzv.started_by_torchrun(_torchrun(0, 2))
    with pytest.raises(RuntimeError, match=r"\$RANK='x'"):
        rdzv.launcher_ranks(_torchrun(0, 2, RANK="x"))


@pytest.mark.parametrize(
    "ranks,advice",
    [
        (rdzv.launcher_ranks(_torchrun(0, 16, local_world=8)), "mpirun"),
        (rdzv.launcher_ranks(_slurm(0, 16, nodes=2)), "srun --mpi=pmix"),
        # Every task of the step, not only the first of a node, gets the way out.
        (rdzv.launcher_ranks(_slurm(9, 16, nodes=2, SLURM_LOCALID="1")), "srun --mpi=pmix"),
    ],
)
def test_ranks_across_nodes_without_mpi_are_refused_with_the_way_out(ranks, advice):
    with pytest.raises(RuntimeError, match="more than one node") as info:
        rdzv.check_single_node(ranks)
    assert advice in str(info.value)


def test_a_rank_with_one_visible_gpu_uses_device_0():
    assert rdzv.visible_device(3, {"CUDA_VISIBLE_DEVICES": "5"}) == 0
    assert rdzv.visible_device(3, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 3
    assert rdzv.visible_device(2, {}) == 2


def test_rank_devices_put_ranks_on_the_gpus_named():
    from megamoe_rt.ep.env import assigned_device
    from megamoe_rt.ep.launch import RankContext

    assert assigned_device(1, {}) is None
    assert assigned_device(1, {"MEGAMOE_RT_RANK_DEVICES": " 0 "}) == 0  # one ordinal: every rank
    assert assigned_device(1, {"MEGAMOE_RT_RANK_DEVICES": "2,0"}) == 0
    assert rdzv.visible_device(3, {"MEGAMOE_RT_RANK_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 0
    for bad, match in [("0,x", "ordinals separated"), ("-1", ">= 0"), ("0,0", "rank 2 has none")]:
        with pytest.raises(ValueError, match=match):
            assigned_device(2, {"MEGAMOE_RT_RANK_DEVICES": bad})
    ctx = RankContext(1, 2, "unused", b"k")
    old = os.environ.pop("MEGAMOE_RT_RANK_DEVICES", None)
    try:
        assert ctx.device == 1
        os.environ["MEGAMOE_RT_RANK_DEVICES"] = "0,0"
        assert ctx.device == 0
        assert RankContext(1, 2, "unused", b"k", device_ordinal=3).device == 3  # the launcher's choice wins
    finally:
        os.environ.pop("MEGAMOE_RT_RANK_DEVICES", None)
        if old is not None:
            os.environ["MEGAMOE_RT_RANK_DEVICES"] = old


def test_a_rendezvous_directory_open_to_others_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    monkeypatch.setenv(rdzv.RENDEZVOUS_DIR_ENV, str(d))
    with pytest.raises(RuntimeError, match="mode 0700"):
        rdzv.private_dir()


def test_a_rendezvous_file_open_to_others_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "private"
    monkeypatch.setenv(rdzv.RENDEZVOUS_DIR_ENV, str(d))
    import threading
    from multiprocessing.connection import Listener

    sock = str(tmp_path / "hub.sock")
    listener = Listener(sock, family="AF_UNIX", authkey=b"k" * 16)
    threading.Thread(target=lambda: listener.accept().close(), daemon=True).start()
    path = rdzv.publish_hub("job-b", sock, b"k" * 16)
    assert rdzv.find_hub("job-b", 5.0) == (sock, b"k" * 16)  # a live hub: taken
    listener.close()
    os.chmod(path, 0o644)
    with pytest.raises(RuntimeError, match="refused"):
        rdzv.find_hub("job-b", 1.0)


def test_a_file_left_by_an_earlier_launch_is_waited_past(tmp_path, monkeypatch):
    monkeypatch.setenv(rdzv.RENDEZVOUS_DIR_ENV, str(tmp_path / "private"))
    rdzv.publish_hub("job-d", str(tmp_path / "gone.sock"), b"k" * 16)  # its hub is gone
    with pytest.raises(TimeoutError, match="does not answer"):
        rdzv.find_hub("job-d", 0.3)


def test_a_missing_rank_0_times_out_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(rdzv.RENDEZVOUS_DIR_ENV, str(tmp_path / "private"))
    with pytest.raises(TimeoutError, match="rendezvous file"):
        rdzv.find_hub("job-c", 0.2)


RANK_SCRIPT = textwrap.dedent("""
    import json, os
    from megamoe_rt.ep.launch import context_from_env
    ctx = context_from_env()
    ctx.barrier()
    everyone = ctx.allgather(bytes([ctx.rank]), key="ranks")
    said = ctx.broadcast(b"from rank 0" if ctx.rank == 0 else None, key="hello")
    ctx.barrier()
    print(json.dumps({"rank": ctx.rank, "device": ctx.device, "all": [e.hex() for e in everyone],
                      "said": said.decode(), "nvls": os.environ.get("NVSHMEM_DISABLE_NVLS")}))
""")


def _run_ranks(envs, tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in MPI_MARKERS + LAUNCH_VARS}
    base[rdzv.RENDEZVOUS_DIR_ENV] = str(tmp_path / "rdzv")
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), base.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            env={**base, **e},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for e in envs
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_ranks_on_one_node_meet_and_exchange(launcher, tmp_path):
    world = 3
    if launcher == "torchrun":
        envs = [_torchrun(r, world) for r in range(world)]
    else:
        envs = [_slurm(r, world, CUDA_VISIBLE_DEVICES=str(r)) for r in range(world)]
    results = sorted(_run_ranks(envs, tmp_path), key=lambda r: r["rank"])
    for r in results:
        assert r["all"] == ["00", "01", "02"] and r["said"] == "from rank 0" and r["nvls"] == "1"
    # torchrun: the local rank; srun with one GPU per task: device 0 of each task's own list
    assert [r["device"] for r in results] == ([0, 1, 2] if launcher == "torchrun" else [0, 0, 0])
    assert not list((tmp_path / "rdzv").glob("rdzv-*")), "rank 0 removes its rendezvous file"


def test_torchrun_wins_over_mpi_variables_an_outer_srun_passed_down(tmp_path):
    envs = [_torchrun(r, 2, PMIX_RANK="0") for r in range(2)]  # the same PMIx rank in every worker
    results = sorted(_run_ranks(envs, tmp_path), key=lambda r: r["rank"])
    assert [r["all"] for r in results] == [["00", "01"]] * 2


def test_torchrun_across_nodes_fails_in_context_from_env(tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in MPI_MARKERS + LAUNCH_VARS}
    env = {**base, **_torchrun(0, 16, local_world=8), rdzv.RENDEZVOUS_DIR_ENV: str(tmp_path / "rdzv")}
    out = subprocess.run(
        [sys.executable, "-c", "from megamoe_rt.ep.launch import context_from_env; context_from_env()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "more than one node" in out.stderr and "mpirun" in out.stderr


def test_ranks_sharing_a_gpu_are_told_apart_by_the_gpus_uuid(monkeypatch):
    import cuda.core

    from megamoe_rt.ep.group import ranks_share_a_gpu

    uuids = {0: "GPU-a", 1: "GPU-b", 2: "GPU-a"}
    monkeypatch.setattr(cuda.core, "Device", lambda ordinal: SimpleNamespace(uuid=uuids[ordinal]))

    class Group:  # a rank's view; allgather answers what the ranks on `devices` would pass
        def __init__(self, devices):
            self.rank, self.world_size, self.devices = 0, len(devices), devices

        @property
        def device(self):
            return self.devices[self.rank]

        def allgather(self, value, *, key="default"):
            assert key == "gpu-uuids" and value == uuids[self.device].encode()
            return [uuids[d].encode() for d in self.devices]

    assert not ranks_share_a_gpu(Group([0, 1]))
    assert ranks_share_a_gpu(Group([0, 1, 2]))
    assert ranks_share_a_gpu(Group([0, 0]))
