"""The process launcher: results, bootstrap broadcast, failure propagation, no orphans (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from megamoe_rt.ep.launch import RankFailed, spawn
from tests.helpers import ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    """Scripts run by the launcher import megamoe_rt from this checkout too."""
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_results_come_back_by_rank():
    assert spawn(ranks.double_rank, 3, args=(1,)) == [1, 3, 5]


def test_rank_zero_broadcasts_and_barriers_meet():
    out = spawn(ranks.share_id, 3)
    uids = {o[0] for o in out}
    assert len(uids) == 1 and next(iter(uids)).startswith(b"uid-")
    assert all(o[1] == "1" for o in out)  # NVLink multicast stays off in every rank
    assert len({o[2] for o in out}) == 3


def test_a_raising_rank_stops_the_others(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn(ranks.one_raises, 3, args=(str(tmp_path),))
    assert info.value.rank == 1 and "rank one is broken" in str(info.value)
    assert time.monotonic() - t0 < 60
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(3)]
    assert not any(_alive(p) for p in pids)


def test_a_dying_rank_is_reported_with_its_status():
    with pytest.raises(RankFailed, match="rank 2 failed: process exited with status 7"):
        spawn(ranks.one_dies, 4)


def test_launch_command_runs_a_script_per_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        from megamoe_rt.ep.launch import context_from_env
        ctx = context_from_env()
        uid = ctx.broadcast(b"abc" if ctx.rank == 0 else None)
        ctx.barrier()
        line = (f"rank {ctx.rank}/{ctx.world_size} uid={uid.decode()} nvls={os.environ['NVSHMEM_DISABLE_NVLS']} "
                f"arg={sys.argv[1]}\\n")
        os.write(1, line.encode())  # one write: lines from the two ranks cannot interleave
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "2", str(script), "X"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("rank"))
    assert lines == ["rank 0/2 uid=abc nvls=1 arg=X", "rank 1/2 uid=abc nvls=1 arg=X"]


def test_launch_devices_put_every_rank_on_the_gpus_named(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from megamoe_rt.ep.launch import context_from_env
        ctx = context_from_env()
        os.write(1, f"rank {ctx.rank} gpu {ctx.device}\\n".encode())
    """)
    )

    def launch(devices):
        cmd = [sys.executable, "-m", "megamoe_rt", "launch", "-n", "3", "--devices", devices, str(script)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())

    out = launch("0")
    assert out.returncode == 0, out.stderr
    assert sorted(l for l in out.stdout.splitlines() if l.startswith("rank")) == [
        "rank 0 gpu 0",
        "rank 1 gpu 0",
        "rank 2 gpu 0",
    ]
    bad = launch("0,1")
    assert bad.returncode != 0 and "names 2 GPUs" in bad.stderr and "rank 0" not in bad.stdout, bad.stderr


def test_launch_command_runs_a_module_per_rank(tmp_path):
    (tmp_path / "rank_job.py").write_text(
        textwrap.dedent("""
        import os, sys
        from megamoe_rt.ep.launch import context_from_env, launched
        ctx = context_from_env()
        ctx.barrier()
        os.write(1, f"module rank {ctx.rank} launched={launched()} arg={sys.argv[1]}\\n".encode())
    """)
    )
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "2", "-m", "rank_job", "Y"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("module"))
    assert lines == ["module rank 0 launched=True arg=Y", "module rank 1 launched=True arg=Y"]


def test_launch_command_stops_the_others_when_one_fails(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        from megamoe_rt.ep.launch import context_from_env
        ctx = context_from_env()
        open(os.path.join(sys.argv[1], f"{ctx.rank}.pid"), "w").write(str(os.getpid()))
        if ctx.rank == 0:
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(120)
    """)
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "3", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert out.returncode == 3
    assert "rank 0 exited with status 3" in out.stderr
    assert time.monotonic() - t0 < 60
    assert not any(_alive(int((tmp_path / f"{r}.pid").read_text())) for r in range(3))


def test_ranks_that_cannot_run_are_reported_in_one_line_for_all(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from megamoe_rt.requirements import report
        sys.exit(report("job", "the frobnicator is missing; install: pip install frobnicator"))
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == ["job: the frobnicator is missing; install: pip install frobnicator"], out.stderr


def test_a_reused_broadcast_key_carries_the_new_value():
    assert spawn(ranks.broadcast_twice, 3) == [(b"one", b"two")] * 3


def test_an_unpicklable_result_is_an_error_not_a_hang():
    with pytest.raises(RankFailed, match=r"rank \d failed: .*pickle"):
        spawn(ranks.unpicklable, 2, timeout=60)


def test_a_rank_exiting_cleanly_without_a_result_is_reported():
    with pytest.raises(RankFailed, match="rank 1 failed: process exited with status 0 without a result"):
        spawn(ranks.quiet_exit, 2, timeout=60)


@pytest.mark.parametrize("nprocs,timeout", [(0, None), (-1, None), (True, None), (2, 0.0), (2, float("nan"))])
def test_launch_script_refuses_bad_counts_and_timeouts_before_starting_anything(nprocs, timeout):
    from megamoe_rt.ep.launch import launch_script

    with pytest.raises(ValueError, match="nprocs|timeout"):
        launch_script(nprocs, "never_started.py", [], timeout=timeout)


def test_a_rank_leaving_without_the_barrier_fails_the_others_at_once():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 failed: .*rank 0 exited without joining barrier #1"):
        spawn(ranks.leaves_before_the_barrier, 2)
    assert time.monotonic() - t0 < 60  # not the hub timeout


def test_a_failed_handshake_does_not_stop_the_hub():
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from megamoe_rt.ep.launch import RankContext, _Hub

    hub = _Hub(1)
    try:
        with pytest.raises(AuthenticationError):
            Client(hub.address, family="AF_UNIX", authkey=b"not the key")
        ctx = RankContext(0, 1, hub.address, hub.key)
        assert ctx.broadcast(b"still served", key="after") == b"still served"
        ctx.barrier()
    finally:
        hub.close()


def test_hub_calls_time_out_naming_the_exchange(monkeypatch):
    from megamoe_rt.ep.launch import HUB_TIMEOUT_ENV, RankContext, _Hub

    monkeypatch.setenv(HUB_TIMEOUT_ENV, "0.5")
    hub = _Hub(2)
    try:
        ctx = RankContext(1, 2, hub.address, hub.key)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank 1: barrier #1 did not complete within 0.5 s"):
            ctx.barrier()
        with pytest.raises(TimeoutError, match=r"broadcast 'uid#1' from rank 0 did not complete"):
            ctx.broadcast(None, key="uid")
        assert time.monotonic() - t0 < 10
    finally:
        hub.close()


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_hub_timeout_is_refused(monkeypatch, raw):
    from megamoe_rt.ep.launch import HUB_TIMEOUT_ENV, hub_timeout_s

    monkeypatch.setenv(HUB_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=HUB_TIMEOUT_ENV):
        hub_timeout_s()


def test_local_ranks_bootstrap_nvshmem_on_loopback(monkeypatch):
    monkeypatch.delenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", raising=False)
    assert spawn(ranks.bootstrap_env, 2) == [("lo", "1"), ("lo", "1")]


def test_a_bootstrap_interface_the_caller_sets_wins(monkeypatch):
    from megamoe_rt.ep.env import rank_env

    monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "ib0")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")  # never honoured: multicast stays off
    assert spawn(ranks.bootstrap_env, 1) == [("ib0", "1")]
    assert rank_env({})["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"


def test_a_broadcast_asked_for_before_it_is_put_arrives():
    assert spawn(ranks.late_root_broadcast, 3) == [b"late"] * 3


def test_allgather_rounds_come_back_in_rank_order():
    rounds = 40
    out = spawn(ranks.gather_rounds, 3, args=(rounds,))
    for got in out:
        assert got == [[f"{r}:{i}".encode() * (1 + i % 7) for r in range(3)] for i in range(rounds)]


def test_a_rank_leaving_before_an_allgather_fails_the_others_at_once():
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 failed: .*rank 0 ended without taking part"):
        spawn(ranks.leaves_before_the_allgather, 2)
    assert time.monotonic() - t0 < 60


def test_an_allgather_times_out_naming_the_missing_rank(monkeypatch):
    from megamoe_rt.ep.launch import HUB_TIMEOUT_ENV, RankContext, _Hub

    monkeypatch.setenv(HUB_TIMEOUT_ENV, "0.3")
    hub = _Hub(2)
    try:
        ctx = RankContext(1, 2, hub.address, hub.key)
        with pytest.raises(TimeoutError, match=r"rank 1: exchange 'status' #1: rank 0 did not take part within 0.3 s"):
            ctx.allgather(b"ok", key="status")
    finally:
        hub.close()


def test_a_failed_nvshmem_bootstrap_is_retried_on_every_rank():
    out = spawn(ranks.bootstrap_with_a_failed_first_attempt, 2, args=({0, 1},))
    assert out == [(None, {"init": 2, "finalize": 0})] * 2  # both failed once, then both got in


def test_a_bootstrap_failing_on_some_ranks_only_is_raised_everywhere_not_retried():
    out = spawn(ranks.bootstrap_with_a_failed_first_attempt, 2, args=({0},))
    texts = {text for text, _ in out}
    assert len(texts) == 1 and "failed on ranks [0] but not the others; not retried" in texts.pop()
    assert all(calls == {"init": 1, "finalize": 0} for _, calls in out)


def test_a_bootstrap_failing_every_time_gives_up_with_every_attempt_named():
    from megamoe_rt.ep.symm import BOOTSTRAP_ATTEMPTS

    out = spawn(ranks.bootstrap_with_a_failed_first_attempt, 2, args=({0, 1}, 99))
    texts = {text for text, _ in out}
    assert len(texts) == 1, texts  # the same error on every rank
    text = texts.pop()
    assert f"failed on all {BOOTSTRAP_ATTEMPTS} attempts" in text and "rank 1: RuntimeError: bootstrap" in text
    assert all(calls == {"init": BOOTSTRAP_ATTEMPTS, "finalize": 0} for _, calls in out)


def test_ranks_out_of_step_in_their_exchanges_all_raise():
    out = spawn(ranks.out_of_step, 2)
    assert all("out of step" in text for text in out), out


def test_a_payload_too_large_to_travel_makes_every_rank_raise():
    out = spawn(ranks.too_large, 2)
    assert all("rank 0 passed 10000 bytes, more than fits" in text for text in out), out
