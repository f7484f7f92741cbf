"""The launcher's liveness and hardening (CPU): handshakes that stall, malformed messages, ranks
that die or stop (under spawn, `megamoe-rt launch`, torchrun and srun), a killed launcher,
squatted directories, bad arguments."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from multiprocessing import process as mp_process
from multiprocessing.connection import Client

import pytest

from megamoe_rt.ep import rendezvous as rdzv
from megamoe_rt.ep import wire
from megamoe_rt.ep.launch import RankContext, RankFailed, _Hub, launch_script, spawn
from tests.helpers import liveness_ranks, ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DETECT_S = 10.0  # a dead or stopped rank is reported on the others within this
MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
OWN_VARS = ("MEGAMOE_RT_RANK", "MEGAMOE_RT_HUB", "MEGAMOE_RT_HEARTBEAT_TIMEOUT_S", "MEGAMOE_RT_HUB_TIMEOUT_S")


def _env(**extra):
    base = {k: v for k, v in os.environ.items() if k not in MPI_MARKERS + OWN_VARS}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, base.get("PYTHONPATH", "")]))
    return {**base, **extra}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_for(pred, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# --- the hub: handshakes and messages ------------------------------------------------------


def _two_ranks_exchange_s(hub) -> float:
    """Seconds two ranks of ``hub`` take for a broadcast and a barrier (each checked)."""
    r0, r1 = RankContext(0, 2, hub.address, hub.key), RankContext(1, 2, hub.address, hub.key)
    got = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: got.setdefault("v", r1.broadcast(None, key="k")))
    t.start()
    assert r0.broadcast(b"value", key="k") == b"value"
    t.join(5)
    b = threading.Thread(target=r1.barrier)
    b.start()
    r0.barrier()
    b.join(5)
    assert got == {"v": b"value"} and not b.is_alive()
    return time.monotonic() - t0


def test_clients_that_never_handshake_delay_no_one(monkeypatch):
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT_S", 1.0)
    hub = _Hub(2)
    stalled = []
    try:
        for _ in range(4):  # connected, the challenge never answered
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(hub.address)
            stalled.append(s)
        assert _two_ranks_exchange_s(hub) < 3.0
        # The hub gives up on each stalled handshake after its timeout: the socket is closed.
        s = stalled[0]
        s.settimeout(5.0)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        assert data.startswith(b"\x00\x00\x00") and b"#CHALLENGE#" in data  # the challenge, then EOF
    finally:
        for s in stalled:
            s.close()
        hub.close()


def test_a_client_that_does_not_read_its_reply_delays_no_other_exchange():
    hub = _Hub(2)
    try:
        big = b"x" * (16 << 20)  # far more than a socket's buffers: its send blocks until read
        put = Client(hub.address, family="AF_UNIX", authkey=hub.key)
        put.send_bytes(wire.encode({"op": "put", "key": "big#1"}, big))
        assert wire.parse_reply(put.recv_bytes())[0]["status"] == "ok"
        sleeper = Client(hub.address, family="AF_UNIX", authkey=hub.key)
        sleeper.send_bytes(wire.encode({"op": "get", "key": "big#1", "root": 0}))  # never read
        time.sleep(0.5)  # the hub is now blocked sending to it (up to its send timeout)
        assert _two_ranks_exchange_s(hub) < 2.0, "an exchange waited for the unread reply"
        sleeper.close()
        put.close()
    finally:
        hub.close()


def test_malformed_messages_get_an_error_reply_and_the_hub_serves_on(monkeypatch):
    hub = _Hub(2)
    try:
        conn = Client(hub.address, family="AF_UNIX", authkey=hub.key)
        bad = [
            b"",
            b"garbage",
            pickle.dumps(("put", "k#1", b"v")),  # the old pickled messages: never unpickled
            wire.encode({"op": "unknown"}),
            wire.encode({"op": "get", "key": 1, "root": 0}),
            wire.encode({"op": "get", "key": "k#1", "root": 7}),
            wire.encode({"op": "barrier", "gen": True, "rank": 0}),
            wire.encode({"op": "barrier", "gen": 0, "rank": 0}),
            wire.encode({"op": "put", "key": "k#1", "extra": 1}),
            wire.encode({"op": "get", "key": "k#1"}),
            wire.encode({"op": "beat"}),
            b"\x05\x00\x00\x00[1,2]",
            b"\xff\xff\x00\x00{}",
        ]
        for raw in bad:
            conn.send_bytes(raw)
            assert conn.poll(5), raw
            reply, _ = wire.parse_reply(conn.recv_bytes())
            assert reply["status"] == "error" and reply["message"].startswith("malformed request"), (raw, reply)
        conn.send_bytes(wire.encode({"op": "put", "key": "k#1"}, b"still served"))
        assert wire.parse_reply(conn.recv_bytes())[0]["status"] == "ok"
        conn.close()
        assert RankContext(1, 2, hub.address, hub.key).broadcast(None, key="k") == b"still served"

        monkeypatch.setattr(wire, "MAX_MESSAGE", 1024)  # too long to read on: an error, then closed
        conn = Client(hub.address, family="AF_UNIX", authkey=hub.key)
        conn.send_bytes(b"x" * 2000)
        reply, _ = wire.parse_reply(conn.recv_bytes())
        assert reply["status"] == "error" and "longer than 1024" in reply["message"]
        with pytest.raises((EOFError, ConnectionResetError)):  # closed with the rest unread
            conn.recv_bytes()
        monkeypatch.undo()
        r0 = RankContext(0, 2, hub.address, hub.key)
        r0._uses["k"] = 1
        assert r0.broadcast(b"again", key="k") == b"again"
    finally:
        hub.close()


# --- ranks that die or stop, under spawn ------------------------------------------------------


@pytest.mark.parametrize("sig,op", [(signal.SIGKILL, "barrier"), (signal.SIGSTOP, "allgather")])
def test_spawn_names_the_rank_that_died_or_stopped_not_a_survivor(tmp_path, sig, op):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn(liveness_ranks.victim_after_barrier, 3, args=(1, sig, str(tmp_path), op), timeout=60)
    took = time.monotonic() - t0
    assert info.value.rank == 1, info.value
    assert ("SIGKILL" in str(info.value)) if sig == signal.SIGKILL else ("stopped" in str(info.value))
    victim = json.loads((tmp_path / "victim.json").read_text())
    assert took < 30 and not _alive(victim["pid"])  # the stopped rank was stopped too
    for r in (0, 2):  # the survivors were told, naming rank 1, if they got to say so
        path = tmp_path / f"{r}.json"
        if path.exists():
            seen = json.loads(path.read_text())
            assert seen["type"] == "RankFailed" and seen["rank"] == 1 and seen["t"] - victim["t"] < DETECT_S


def test_a_rank_busy_without_hub_calls_is_not_taken_for_failed(monkeypatch):
    monkeypatch.setenv("MEGAMOE_RT_HEARTBEAT_TIMEOUT_S", "1")
    assert spawn(liveness_ranks.busy_then_meet, 2, args=(3.0,), timeout=60) == [0, 1]


# --- the same under `megamoe-rt launch`, torchrun and srun --------------------------------------

RANK_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from megamoe_rt.ep.launch import context_from_env
    from tests.helpers.liveness_ranks import victim_after_barrier
    out_dir, victim, sig, op = sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3]), sys.argv[4]
    ctx = context_from_env()
    with open(os.path.join(out_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    victim_after_barrier(ctx, victim, sig, out_dir, op)
""")


def _survivors_saw(out_dir, world, victim):
    """What each survivor raised: RankFailed naming ``victim``, within DETECT_S of its end."""
    v = json.loads((out_dir / "victim.json").read_text())
    delays = []
    for r in range(world):
        if r == victim:
            continue
        seen = json.loads((out_dir / f"{r}.json").read_text())
        assert seen["type"] == "RankFailed" and seen["rank"] == victim, seen
        assert f"rank {victim} failed" in seen["text"], seen
        delays.append(seen["t"] - v["t"])
    assert max(delays) < DETECT_S, delays
    return delays


@pytest.mark.parametrize("sig,op", [("SIGKILL", "barrier"), ("SIGSTOP", "barrier")])
def test_launch_reports_a_dead_or_stopped_rank_on_the_others(tmp_path, sig, op):
    script = tmp_path / "job.py"
    script.write_text(RANK_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "3", str(script), str(tmp_path), "1", sig, op],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert out.returncode != 0
    _survivors_saw(tmp_path, 3, 1)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("megamoe-rt launch: rank 1 ") and "stopping the other ranks" in last, out.stderr
    assert ("SIGKILL" in last) if sig == "SIGKILL" else ("stopped responding" in last), last
    assert not any(_alive(int((tmp_path / f"{r}.pid").read_text())) for r in range(3))


def _torchrun_env(rank, world, job):
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_PORT": "29533",
        "TORCHELASTIC_RUN_ID": job,
    }


def _slurm_env(rank, world, job):
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
    }


@pytest.mark.parametrize(
    "launcher,victim,sig,op",
    [
        ("torchrun", 1, "SIGKILL", "barrier"),
        ("torchrun", 1, "SIGSTOP", "allgather"),
        ("torchrun", 0, "SIGKILL", "barrier"),  # rank 0 serves the hub
        ("torchrun", 0, "SIGSTOP", "barrier"),
        ("slurm", 1, "SIGKILL", "allgather"),
        ("slurm", 0, "SIGKILL", "allgather"),
    ],
)
def test_ranks_of_torchrun_and_srun_report_a_dead_or_stopped_rank(tmp_path, launcher, victim, sig, op):
    world = 3
    job = f"liveness-{os.getpid()}-{victim}-{sig}-{op}-{time.monotonic_ns()}"
    make = _torchrun_env if launcher == "torchrun" else _slurm_env
    env = _env(**{rdzv.RENDEZVOUS_DIR_ENV: str(tmp_path / "rdzv")})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(tmp_path), str(victim), sig, op],
            env={**env, **make(r, world, job)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        errs = {}
        for r, p in enumerate(procs):
            if r != victim:
                errs[r] = p.communicate(timeout=40)[1]
                assert p.returncode != 0, errs[r]
                assert "ConnectionRefusedError" not in errs[r].splitlines()[-1], errs[r]
        _survivors_saw(tmp_path, world, victim)
    finally:
        for p in procs:
            _kill(p.pid)
            p.wait()


# --- the launcher dies ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_context", [True, False])
def test_ranks_end_when_the_launcher_is_killed(tmp_path, with_context):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        if {with_context}:
            from megamoe_rt.ep.launch import context_from_env
            context_from_env().barrier()
        with open(os.path.join(sys.argv[1], f"{{os.environ['MEGAMOE_RT_RANK']}}.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    """)
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "2", str(script), str(tmp_path)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        assert _wait_for(lambda: all((tmp_path / f"{r}.pid").exists() for r in range(2)), 30)
        time.sleep(0.1)
        pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
        assert all(_alive(p) for p in pids)
        launcher.kill()
        launcher.wait()
        t0 = time.monotonic()
        assert _wait_for(lambda: not any(_alive(p) for p in pids), 5.0), "ranks outlived their launcher"
        assert time.monotonic() - t0 < 5.0
    finally:
        launcher.kill()
        launcher.wait()
        for p in pids:
            _kill(p)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_spawned_ranks_die_with_their_parent():
    assert spawn(liveness_ranks.death_signal, 2) == [signal.SIGKILL] * 2


def test_a_rank_ending_with_os_exit_0_is_no_failure_of_the_launch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os
        from megamoe_rt.ep.launch import context_from_env
        context_from_env().barrier()
        os._exit(0)  # no goodbye to the hub, status 0
    """)
    )
    cmd = [sys.executable, "-m", "megamoe_rt", "launch", "-n", "2", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0 and out.stderr == "", out.stderr


# --- private directories -------------------------------------------------------------------------


def test_a_squatted_rendezvous_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(rdzv.RENDEZVOUS_DIR_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squat = tmp_path / f"megamoe-rt-{os.getuid()}"
    squat.mkdir()
    squat.chmod(0o777)  # planted by someone else for everyone
    with pytest.raises(RuntimeError, match="mode 0700"):
        rdzv.private_dir()
    squat.rmdir()
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    squat.symlink_to(other)  # a link to a directory chosen by whoever made it
    with pytest.raises(RuntimeError, match="not a directory"):
        rdzv.private_dir()
    squat.unlink()
    if os.getuid() == 0:  # as root: a 0700 directory another user owns
        squat.mkdir(mode=0o700)
        os.chown(squat, 4242, 4242)
        with pytest.raises(RuntimeError, match="owned by uid 4242"):
            rdzv.private_dir()


def test_each_hub_gets_a_fresh_private_directory_whatever_was_planted(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squat = tmp_path / f"megamoe-rt-{os.getuid()}"
    squat.mkdir()
    squat.chmod(0o777)
    (squat / "hub.sock").write_text("planted")
    hubs = [_Hub(1), _Hub(1)]
    try:
        dirs = {os.path.dirname(h.address) for h in hubs}
        assert len(dirs) == 2 and str(squat) not in dirs
        for d in dirs:
            st = os.lstat(d)
            assert st.st_uid == os.getuid() and (st.st_mode & 0o777) == 0o700
        ctx = RankContext(0, 1, hubs[0].address, hubs[0].key)
        ctx.barrier()
    finally:
        for h in hubs:
            h.close()
    assert (squat / "hub.sock").read_text() == "planted"


# --- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,exc,name",
    [
        (lambda: spawn(True), TypeError, None),  # no nprocs at all
        (lambda: spawn(True, 2), TypeError, "fn"),
        (lambda: spawn(lambda ctx: 0, 1), TypeError, "fn"),  # not importable by the ranks
        (lambda: spawn(ranks.double_rank, True), TypeError, "nprocs"),
        (lambda: spawn(ranks.double_rank, 2.0), TypeError, "nprocs"),
        (lambda: spawn(ranks.double_rank, "2"), TypeError, "nprocs"),
        (lambda: spawn(ranks.double_rank, 0), ValueError, "nprocs"),
        (lambda: spawn(ranks.double_rank, 1, args=5), TypeError, "args"),
        (lambda: spawn(ranks.double_rank, 1, args="ab"), TypeError, "args"),
        (lambda: spawn(ranks.double_rank, 1, timeout=True), TypeError, "timeout"),
        (lambda: spawn(ranks.double_rank, 1, timeout=-1), ValueError, "timeout"),
        (lambda: launch_script(True, "x.py", []), TypeError, "nprocs"),
        (lambda: launch_script(2.5, "x.py", []), TypeError, "nprocs"),
        (lambda: launch_script(2, 5, []), TypeError, "script"),
        (lambda: launch_script(2, "x.py", "ab"), TypeError, "script_args"),
        (lambda: launch_script(2, "x.py", [1]), TypeError, "script_args"),
        (lambda: launch_script(2, "x.py", [], module="yes"), TypeError, "module"),
        (lambda: launch_script(2, "x.py", [], devices=0), TypeError, "devices"),
    ],
)
def test_bad_arguments_to_the_launchers_are_refused_naming_them(call, exc, name):
    with pytest.raises(exc) as info:
        call()
    if name is not None:
        assert str(info.value).startswith(f"{name}:"), info.value


def test_a_bad_heartbeat_timeout_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("MEGAMOE_RT_HEARTBEAT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MEGAMOE_RT_HEARTBEAT_TIMEOUT_S"):
        spawn(ranks.double_rank, 1, args=(0,))
    with pytest.raises(ValueError, match="MEGAMOE_RT_HEARTBEAT_TIMEOUT_S"):
        launch_script(1, "never_started.py", [])


def test_spawn_whose_ranks_cannot_start_raises_why_and_leaves_no_hub_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TypeError, match="args: cannot be sent to the ranks"):  # checked before any hub
        spawn(ranks.double_rank, 2, args=(lambda: None,))

    class Unsendable:  # pickles in the parent, fails while the rank process is being started
        def __reduce__(self):
            if os.environ.get("MEGAMOE_RT_TEST_STARTING") == "1":
                raise pickle.PicklingError("refused while starting a rank")
            return (int, (0,))

    real_start = mp_process.BaseProcess.start

    def start(self):
        os.environ["MEGAMOE_RT_TEST_STARTING"] = "1"
        try:
            return real_start(self)
        finally:
            os.environ.pop("MEGAMOE_RT_TEST_STARTING", None)

    monkeypatch.setattr(mp_process.BaseProcess, "start", start)
    with pytest.raises(pickle.PicklingError, match="refused while starting a rank"):  # the start's own error
        spawn(ranks.double_rank, 2, args=(Unsendable(),))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("megamoe-rt-")], list(tmp_path.iterdir())


def test_find_hub_keeps_its_deadline_against_a_listener_that_never_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(rdzv, "private_dir", lambda: str(tmp_path))
    address = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)  # accepts (in the kernel's backlog) and never speaks
    try:
        path = tmp_path / rdzv._file_name("silent-job")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": address, "key": os.urandom(16).hex()}, f)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not name a live hub"):
            rdzv.find_hub("silent-job", 1.5)
        assert time.monotonic() - start < 5.0
    finally:
        listener.close()


def test_rank_0_stopped_by_sigterm_still_closes_its_hub_and_removes_its_rendezvous_file(tmp_path):
    """torchrun and srun stop workers with SIGTERM, which skips atexit by default."""
    record, marker = tmp_path / "rdzv.json", tmp_path / "closed"
    record.write_text("{}")
    script = textwrap.dedent(
        f"""
        import pathlib, sys, time
        from megamoe_rt.ep import rendezvous
        rendezvous.remove_at_exit({str(record)!r}, lambda: pathlib.Path({str(marker)!r}).write_text("closed"))
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert marker.read_text() == "closed" and not record.exists()


def test_launch_script_gives_the_callers_signal_handlers_back_and_runs_from_a_thread(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('rank ran')\n")

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert launch_script(2, str(script), []) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
        status = []
        t = threading.Thread(target=lambda: status.append(launch_script(2, str(script), [])))
        t.start()
        t.join(120)
        assert status == [0]
    finally:
        signal.signal(signal.SIGTERM, before)
