"""The fault suite's runner (the faults themselves need a GPU: bench/results/faults_*.md).

Here: the faults are registered, each has a limit, ``--only`` refuses unknown names, the rows carry
what each process saw, every fault's script compiles and names only what exists, and the plumbing
of the faults across ranks (the launchers, the signals, the notes, the verdicts) runs with the
layer's exchanges standing in for its calls (``kind="host"``: no GPU)."""

from __future__ import annotations

import ast
import errno
import importlib
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

import pytest

from megamoe_rt.cli import faults, faults_ep

NEW_FAULTS = {
    "rank_sigkill_mid_call",
    "rank_sigstop_mid_call",
    "torchrun_rank_sigkill_mid_call",
    "torchrun_rank_sigstop_mid_call",
    "launcher_killed",
    "oom_at_construction_one_rank",
    "cache_dir_read_only",
    "cache_dir_full",
    "producer_never_publishes",
    "settings_differ_across_ranks",
    "stalled_hub_client",
}


def test_unknown_faults_are_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        faults.main(["--only", "nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown fault 'nope'" in err and "rank_sigstop_mid_call" in err


def test_an_unknown_fault_among_known_ones_exits_2_as_the_user_runs_it(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt.cli.faults", "--only", "rank_sigkill_mid_call,nope"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "unknown fault 'nope'" in out.stderr and out.stdout == ""


def test_only_takes_the_new_faults():
    names = ",".join(sorted(NEW_FAULTS))
    a, chosen = faults._arguments(["--only", names])
    assert chosen == sorted(NEW_FAULTS) and a.limit is None


def test_the_table_has_a_row_per_fault_and_escapes_pipes():
    rows = [
        faults.FaultRow("a", "x", "ValueError: p|q", 0.5, "yes", 1.0, False),
        faults.FaultRow("b", "y", "HANG: no result within 1 s", None, None, 1.0, True),
    ]
    text = faults.markdown(rows)
    assert text.count("\n") == 4 and "p/q" in text and "| 0.500 s |" in text and "| yes |" in text


def test_the_rows_carry_what_each_process_saw():
    row = faults.FaultRow("a", "x", "rank 0: RankFailed", 0.1, "no", 2.0, False, ["rank 0: A|B", "rank 1: C"])
    header, rule, line = faults.markdown([row]).splitlines()
    assert header.endswith("| what each process saw |") and rule.count("|") == header.count("|")
    assert line.endswith("| rank 0: A/B<br>rank 1: C |") and line.count("|") == header.count("|")
    assert asdict(row)["seen"] == ["rank 0: A|B", "rank 1: C"]
    plain = faults.markdown([faults.FaultRow("b", "y", "ok", None, None, 1.0, False)]).splitlines()[2]
    assert plain.endswith("| no | - |")


def test_every_fault_the_issue_lists_has_a_scenario():
    assert {
        "withheld_signal",
        "rank_killed_mid_call",
        "single_wave_past_ring",
        "ring_too_small",
        "bad_input_one_rank",
        "planted_cache_entry",
        "weights_reloaded_under_graph",
        "timeout_zero",
        "timeout_huge",
    } <= set(faults._SCENARIOS)
    assert set(faults._SCENARIOS) >= NEW_FAULTS


def test_every_fault_has_a_short_limit_and_its_waits_end_before_it():
    assert set(faults._LIMITS) <= set(faults._SCENARIOS)
    for name in faults._SCENARIOS:
        limit = faults.limit_for(name)
        assert 0 < limit <= 90, name
        script = faults.script_of(name)
        ns: dict = {}
        exec(script[script.index("LIMIT_S, INNER_S") :].splitlines()[0], ns)
        assert ns["LIMIT_S"] == limit and 0 < ns["INNER_S"] < limit, name
    assert faults.limit_for("rank_sigkill_mid_call", 7.0) == 7.0
    # Every fault at its usual time (a few seconds) keeps the suite to minutes; all hanging at
    # once is bounded too.
    assert sum(faults.limit_for(n) for n in faults._SCENARIOS) < 25 * 60


@pytest.mark.parametrize("name", sorted(faults._SCENARIOS))
def test_every_fault_script_compiles_and_names_what_exists(name):
    script = faults.script_of(name)
    tree = ast.parse(compile(script, name, "exec", flags=ast.PyCF_ONLY_AST))
    compile(script, name, "exec")
    modules = {"faults": faults, "faults_ep": faults_ep}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megamoe_rt"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    name,
                    node.module,
                    alias.name,
                )
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), (name, node.value.id, node.attr)


def test_the_prelude_runs_without_a_gpu():
    pytest.importorskip("cupy")
    ns: dict = {}
    exec(compile(faults._PRELUDE, "prelude", "exec"), ns)
    assert ns["first_line"](ValueError("a\n  b")) == "ValueError: a b"


def _fake_fault(monkeypatch, body: str) -> None:
    pytest.importorskip("cupy")  # the prelude imports it
    monkeypatch.setitem(faults._SCENARIOS, "fake", ("a fake fault", body))


def test_a_fault_process_reports_its_row_with_what_each_process_saw(monkeypatch):
    _fake_fault(monkeypatch, 'report("rank 0: X", 0.25, "yes", ["rank 0: X", "rank 1: gone"])\n')
    row = faults.run_fault("fake", 60.0)
    assert (row.outcome, row.detect_s, row.later_calls, row.seen, row.hang) == (
        "rank 0: X",
        0.25,
        "yes",
        ["rank 0: X", "rank 1: gone"],
        False,
    )


def test_a_fault_past_its_limit_is_a_hang(monkeypatch):
    _fake_fault(monkeypatch, "time.sleep(120)\n")
    row = faults.run_fault("fake", 5.0)
    assert row.hang and row.outcome == "HANG: no result within 5 s"


# --- faults across ranks: the plumbing, the layer's exchanges standing in for its calls ---------


@pytest.fixture
def fast_heartbeat(monkeypatch):
    monkeypatch.setenv("MEGAMOE_RT_HEARTBEAT_TIMEOUT_S", "1")
    for name in ("MEGAMOE_RT_RANK", "MEGAMOE_RT_HUB", "MEGAMOE_RT_HUB_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)


def _no_leftovers(before: set[str]) -> None:
    left = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("megamoe-rt-fault-")} - before
    assert not left, left


def _scratch_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("megamoe-rt-fault-")}


@pytest.mark.parametrize("how", ["launch", "torchrun"])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_rank_signalled_mid_call_is_named_on_the_other(fast_heartbeat, how, sig):
    before = _scratch_dirs()
    driver = faults_ep.signal_mid_call_launched if how == "launch" else faults_ep.signal_mid_call_torchrun
    outcome, detect, later, seen = driver(sig, kind="host", timeout_s=40.0)
    assert outcome.startswith("rank 0: RankFailed: rank 1 failed"), (outcome, seen)
    assert detect is not None and 0 <= detect < (1.0 if sig == "SIGKILL" else 4.0), seen
    assert later.startswith("no") and seen[1] == f"rank 1: sent itself {sig} right after launching a call"
    if how == "launch":
        assert seen[-1].startswith("launcher: exit status") and "rank 1" in seen[-1], seen
    else:
        assert seen[-2] == "rank 0 process: exit status 1", seen
        assert seen[-1] == (
            "rank 1 process: exit status -9 (killed by SIGKILL)"
            if sig == "SIGKILL"
            else "rank 1 process: still there after 3 s; the suite killed it"
        ), seen
    _no_leftovers(before)


def test_the_ranks_of_a_killed_launcher_are_gone_within_moments(fast_heartbeat):
    before = _scratch_dirs()
    outcome, detect, later, seen = faults_ep.launcher_killed(kind="host", timeout_s=40.0)
    assert outcome.startswith("every rank gone within"), (outcome, seen)
    assert detect is not None and detect < 2.0 and len(seen) == 2
    _no_leftovers(before)


def test_stalled_hub_clients_delay_no_exchange(fast_heartbeat):
    outcome, detect, later, seen = faults_ep.stalled_hub_client_launched(kind="host", timeout_s=40.0)
    assert outcome.startswith("calls complete with 8 stalled clients"), (outcome, seen)
    assert later == "yes" and seen[-1].startswith("launcher: exit status 0"), seen


def test_a_rank_body_that_is_not_one_is_refused(capsys):
    assert faults_ep.main(["nope", "/tmp"]) == 2
    assert "signal_mid_call" in capsys.readouterr().err


def test_torchrun_like_ranks_carry_what_the_rendezvous_reads(monkeypatch):
    from megamoe_rt.ep import rendezvous
    from megamoe_rt.ep.env import RANK_DEVICES_ENV

    monkeypatch.setenv("MEGAMOE_RT_HUB", "/somewhere/hub.sock")
    monkeypatch.setenv("MEGAMOE_RT_RANK", "3")
    env = faults_ep.torchrun_env(1, "/rdzv", "run-x")
    ranks = rendezvous.torchrun_ranks(env)
    assert ranks is not None and (ranks.rank, ranks.world_size, ranks.local_rank) == (1, 2, 1)
    assert rendezvous.started_by_torchrun(env) and rendezvous.visible_device(1, env) == 0
    assert env[RANK_DEVICES_ENV] == "0" and env[rendezvous.RENDEZVOUS_DIR_ENV] == "/rdzv"
    assert "MEGAMOE_RT_HUB" not in env and "MEGAMOE_RT_RANK" not in env


def test_the_launch_command_puts_both_ranks_on_gpu_0():
    cmd = faults_ep.launch_command(faults_ep.call_loop, "/out", ["layer"], 30.0)
    assert cmd[1:9] == ["-m", "megamoe_rt", "launch", "-n", "2", "--devices", "0", "--timeout"]
    assert cmd[-5:] == ["-m", "megamoe_rt.cli.faults_ep", "call_loop", "/out", "layer"]


# --- the verdicts ---------------------------------------------------------------------------------


def _signal(survivor: str, after_s: float) -> str:
    notes = {"victim": {"t": 100.0}, "0": {"seen": survivor, "t": 100.0 + after_s}}
    return faults_ep._signal_row("SIGSTOP", notes, [])[0]


def test_a_survivor_that_does_not_name_the_rank_or_is_late_is_wrong():
    assert _signal("RankFailed: rank 1 failed: stopped", 5.5).startswith("rank 0: RankFailed")
    assert _signal("RankFailed: rank 1 failed: stopped", 12.0).startswith("WRONG: named after 12.0 s")
    assert _signal("TimeoutError: the exchange timed out", 5.0).startswith("WRONG: rank 0's error does not name")
    assert _signal(faults_ep.NO_ERROR, 1.0).startswith("no error")
    assert faults_ep._signal_row("SIGKILL", {}, ["launcher: x"])[0].startswith("WRONG: rank 1 did not get")


def _every(seen0: str, seen1: str, expect: str | None = "ValueError") -> str:
    notes = {str(r): {"seen": s, "took": 0.1, "later": "yes"} for r, s in enumerate((seen0, seen1))}
    return faults_ep._every_rank_row(notes, [], expect)[0]


def test_every_rank_must_raise_the_same_error_naming_rank_1():
    text = "ValueError: MegaMoE: the ranks construct different layers: swiglu_limit (rank 0: None, rank 1: 8.0)"
    assert _every(text, text) == f"every rank: {text}"
    assert _every(text, text + " ").startswith("WRONG: the ranks raised different errors")
    assert _every("RuntimeError: rank 1 x", "RuntimeError: rank 1 x").startswith("WRONG: every rank raised, but not")
    assert _every("RuntimeError: rank 1 x", "RuntimeError: rank 1 x", None) == "every rank: RuntimeError: rank 1 x"
    assert _every("ValueError: rank 0 only", "ValueError: rank 0 only").startswith("WRONG: the error does not name")
    assert _every(faults_ep.NO_ERROR, faults_ep.NO_ERROR).startswith("no error")
    assert faults_ep._every_rank_row({"0": {"seen": "x", "took": 0.1, "later": "yes"}}, [], None)[0].startswith(
        "WRONG: rank(s) [1] left no note"
    )


# --- the kernel cache's faults --------------------------------------------------------------------


def _store_one() -> bool:
    from megamoe_rt.jit.cache import CubinCache

    return CubinCache().store("k" * 40, b"\0" * 8192, {}) is None  # True: refused, the kernel runs from memory


@pytest.fixture(params=["as it is", "no mount"])
def mounts(request, monkeypatch):
    """The helpers as this process is, and as one that cannot mount (not root): they fall back."""
    if request.param == "no mount":
        monkeypatch.setattr(faults, "_mount_tmpfs", lambda directory, options: False)
    return request.param


def test_the_read_only_cache_directory_refuses_every_write_and_warns_once(mounts):
    made = faults.read_only_cache_dir()
    if made is None:
        pytest.skip("no directory here that this process cannot write into")
    assert not faults._writable(made.path)
    before = os.environ.get("MEGAMOE_RT_CACHE")
    outcome, took, later, seen = faults.cache_fault(made, lambda: _store_one() and _store_one())
    assert outcome.startswith(f"one warning ({made.how})") and later == "yes", (outcome, seen)
    assert os.environ.get("MEGAMOE_RT_CACHE") == before
    assert made.path == "/proc/self" or not os.path.exists(made.path)  # removed (unmounted) afterwards


def test_the_full_cache_directory_fails_writes_with_enospc(mounts):
    made = faults.full_cache_dir()
    if mounts == "no mount":
        assert made.how.startswith("ENOSPC simulated")
    try:
        with made.fault, pytest.raises(OSError) as exc, open(os.path.join(made.path, "entry"), "wb") as f:
            f.write(b"\0" * 8192)
            f.flush()
            os.fsync(f.fileno())
        assert exc.value.errno == errno.ENOSPC
    finally:
        made.cleanup()
    assert not os.path.exists(made.path)


def test_a_cache_fault_counts_the_warnings_as_they_are_shown(mounts):
    outcome, _, later, seen = faults.cache_fault(faults.full_cache_dir(), _store_one)
    assert outcome.startswith("one warning (") and "No space left on device" in outcome and later == "yes"
    assert seen and seen[0].startswith("warning: megamoe_rt: cannot write the kernel cache entry")
    assert faults.cache_fault(None, _store_one)[0].startswith("not run")
