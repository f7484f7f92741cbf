"""One output convention for every ``megamoe-rt`` command (megamoe_rt/cli/output.py): ``--json``
prints the result as JSON on stdout and nothing else there, ``-o/--output FILE`` writes the same
JSON to FILE, and every file a command will write is checked before it does any work (one line,
exit status 2). Chart options need matplotlib, checked up front too (one line, exit status 1)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import megamoe_rt.cli.commands as commands
import megamoe_rt.cli.main as cli
from megamoe_rt.cli import output, plotting

H200 = SimpleNamespace(ordinal=0, name="NVIDIA H200", sm_count=132)
PLOT_INSTALL = 'pip install "megamoe-rt[plot]"'


def _gpu_probed(*args, **kwargs):
    raise AssertionError("the GPU was probed (or the work started) before the output options were checked")


@pytest.fixture
def no_gpu(monkeypatch):
    """Every way a command reaches the GPU fails the test."""
    import megamoe_rt.requirements as requirements

    monkeypatch.setattr(commands, "hopper_or_none", _gpu_probed)
    monkeypatch.setattr(requirements, "gpu_or_report", _gpu_probed)


def one_line(capsys, status: int, expected: int = 2) -> str:
    """The single stderr line a command that stopped printed; nothing on stdout."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert status == expected, captured.err
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == "", captured.out
    return lines[0]


# --- every command takes both options -----------------------------------------------------------

# The least each command needs to parse; a command added to the CLI must be added here (below).
MINIMAL_ARGV = {
    "info": [],
    "plan": [],
    "partitions": [],
    "demo": [],
    "scaleout": [],
    "sweep": ["--spec", "membound_vs_gemm"],
    "tune-split": ["--tokens", "64"],
    "trace": [],
    "bench": ["moe"],
    "compile": ["--all"],
}
NO_RESULT = {"launch"}  # runs a script: the script's output is its own


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_command_is_listed_here():
    assert set(_subcommands()) == set(MINIMAL_ARGV) | NO_RESULT


@pytest.mark.parametrize("command", sorted(MINIMAL_ARGV))
@pytest.mark.parametrize("flag", ["-o", "--output"])
def test_every_command_with_a_result_takes_json_and_output(command, flag):
    parser = cli.build_parser()
    base = [command, *MINIMAL_ARGV[command]]
    a = parser.parse_args(base)
    assert (a.json, a.output) == (False, None)
    a = parser.parse_args([*base, "--json", flag, "r.json"])
    assert (a.json, a.output) == (True, "r.json")


def test_compile_checks_its_output_path_before_building(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "compile", "--all", "-o", str(tmp_path / "no" / "k.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "-o/--output" in out.stderr and "does not exist" in out.stderr, out.stderr
    assert "[" not in out.stderr  # no progress line: nothing was built


@pytest.mark.parametrize(
    "parse",
    [
        pytest.param(lambda argv: _module_parser("tune_split").parse_args(["--tokens", "64", *argv]), id="tune_split"),
        pytest.param(lambda argv: _module_parser("trace").parse_args(argv), id="trace"),
        *[
            pytest.param(lambda argv, what=what: _ep_arguments(argv, what), id=f"bench {what} across ranks")
            for what in ("moe", "overhead", "prefill", "stream")
        ],
        pytest.param(lambda argv: _faults_arguments(argv), id="faults"),
    ],
)
def test_the_module_entry_points_take_json_and_output(parse, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the fault suite checks its -o file while it parses
    a = parse(["--json", "-o", "r.json"])
    assert (a.json, a.output) == (True, "r.json")
    a = parse([])
    assert (a.json, a.output) == (False, None)


def _module_parser(name: str) -> argparse.ArgumentParser:
    import importlib

    ap = argparse.ArgumentParser()
    importlib.import_module(f"megamoe_rt.cli.{name}").add_arguments(ap)
    return ap


def _ep_arguments(argv: list[str], what: str) -> argparse.Namespace:
    from megamoe_rt.cli.bench_ep import ep_arguments

    return ep_arguments(argv, what)


def _faults_arguments(argv: list[str]) -> argparse.Namespace:
    from megamoe_rt.cli import faults

    return faults._arguments(argv)[0]


# --- --json on stdout, -o to a file ------------------------------------------------------------

PLAN = ["plan", "--preset", "flash", "--tokens", "2048", "--ranks", "8"]


def test_plan_json_is_all_there_is_on_stdout(capsys):
    assert cli.main([*PLAN, "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # the whole of stdout: no table before or after
    assert data["preset"] == "flash" and data["num_ranks"] == 8 and data["regions"]


def test_plan_output_writes_the_json_it_prints_and_still_prints_the_table(capsys, tmp_path):
    assert cli.main([*PLAN, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    path = tmp_path / "plan.json"
    assert cli.main([*PLAN, "-o", str(path)]) == 0
    assert json.loads(path.read_text()) == printed
    assert "preset flash" in capsys.readouterr().out  # the table, as without -o
    both = tmp_path / "both.json"
    assert cli.main([*PLAN, "--json", "--output", str(both)]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(both.read_text()) == printed


def test_plan_json_as_a_user_runs_it(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", *PLAN, "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_experts"] == 256


def test_info_json_parses_and_says_what_the_table_says(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["versions"]["megamoe_rt"] and data["versions"]["python"]
    assert {"nvrtc", "headers", "nvshmem", "cache", "driver_cuda", "gpus"} <= set(data)
    assert isinstance(data["gpus"], list) and isinstance(data["cache"]["entries"], int)
    assert cli.main(["info"]) == 0
    table = capsys.readouterr().out
    assert data["cache"]["directory"] in table and data["versions"]["megamoe_rt"] in table


def test_scaleout_json_and_output(capsys, tmp_path):
    path = tmp_path / "s.json"
    assert cli.main(["scaleout", "--preset", "v3", "--ranks", "16", "--tokens", "8192", "--json", "-o", str(path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == json.loads(path.read_text()) and [r["num_ranks"] for r in rows] == [16]


def test_a_benchmark_with_json_prints_its_rows_alone_and_its_progress_on_stderr(monkeypatch, capsys, tmp_path):
    import megamoe_rt.cli.benchmarks as benchmarks

    seen = {}

    def fake_bench_moe(presets, tokens, **kw):
        seen.update(kw)
        print("flash T=64 progress line", flush=True)
        return [{"preset": "flash", "tokens": 64, "median_us": 1.5}]

    monkeypatch.setattr(commands, "hopper_or_none", lambda command: H200)
    monkeypatch.setattr(benchmarks, "bench_moe", fake_bench_moe)
    path = str(tmp_path / "b.json")
    assert cli.main(["bench", "moe", "--tokens", "64", "--json", "-o", path]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == [{"preset": "flash", "tokens": 64, "median_us": 1.5}]
    assert "progress line" in captured.err and "device 0: NVIDIA H200" in captured.err
    assert seen["json_path"] == path  # the benchmark writes the -o file itself, after every cell


def test_sweep_by_name_with_json(monkeypatch, capsys):
    import megamoe_rt.graph.sweep as sweep

    calls = []

    def fake_run_sweep(spec, vary, values, *, device, reps):
        calls.append(spec.name)
        return [{"value": None, "partitions": {"gemm": 64, "copy": 64}, "nodes_us": {"gemm": 1.0}, "total_us": 2.0}]

    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(commands, "hopper_or_none", lambda command: H200)
    assert cli.main(["sweep", "--spec", "membound_vs_gemm", "--json"]) == 0
    captured = capsys.readouterr()
    assert calls == ["membound_vs_gemm"]
    data = json.loads(captured.out)
    assert (data["spec"], data["vary"], data["device"]) == ("membound_vs_gemm", None, "NVIDIA H200")
    assert "partitions as specified" in captured.err  # the table, off stdout


def test_the_trace_goes_to_trace_json_unless_told_otherwise():
    from megamoe_rt.cli import trace

    def parsed(*argv: str) -> argparse.Namespace:
        a = _module_parser("trace").parse_args(list(argv))
        trace.check_arguments(a)
        return a

    assert parsed().output == trace.DEFAULT_OUTPUT
    assert parsed("--json").output is None  # on stdout only
    assert parsed("-o", "t.json", "--json").output == "t.json"


# --- the output path, checked before the work ---------------------------------------------------


def test_unwritable_says_why():
    assert output.unwritable("r.json") is None
    assert output.unwritable("/nonexistent/r.json") == "directory /nonexistent does not exist"
    assert output.unwritable("/") == "is a directory"
    assert output.unwritable("out/") == "is a directory"
    assert output.unwritable("") == "is a directory"


def test_unwritable_names_a_file_in_the_way_and_a_read_only_directory(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    assert output.unwritable(str(tmp_path / "file" / "r.json")) == f"{tmp_path / 'file'} is not a directory"
    assert output.unwritable(str(tmp_path)) == "is a directory"
    monkeypatch.setattr(output.os, "access", lambda path, mode: False)  # root may write anywhere: say it cannot
    assert output.unwritable(str(tmp_path / "r.json")) == f"directory {tmp_path} is not writable"
    assert output.unwritable(str(tmp_path / "file")) == "is not writable"


MISSING = "/nonexistent/x.json"

# Commands that would otherwise take long or need a GPU; each must stop at its -o path first.
SLOW_OR_GPU = [
    ["bench", "moe"],
    ["bench", "gemm"],
    ["bench", "prefill"],
    ["bench", "stream"],
    ["bench", "overhead"],
    ["partitions"],
    ["demo"],
    ["sweep", "--spec", "membound_vs_gemm", "--vary", "gemm=16..32:16"],
    ["tune-split", "--tokens", "64"],
    ["trace"],
    ["plan"],
    ["info"],
    ["scaleout"],
]


@pytest.mark.parametrize("argv", SLOW_OR_GPU, ids=" ".join)
def test_a_missing_output_directory_stops_the_command_before_its_work(capsys, no_gpu, argv):
    line = one_line(capsys, cli.main([*argv, "-o", MISSING]))
    assert line.endswith(f"-o/--output {MISSING}: directory /nonexistent does not exist"), line
    assert line.startswith(f"megamoe-rt {argv[0]}")


@pytest.mark.parametrize(
    "argv, option",
    [
        (["bench", "prefill", "--png", "/nonexistent/p.png"], "--png"),
        (["tune-split", "--tokens", "64", "--png", "/nonexistent/p.png"], "--png"),
        (["sweep", "--spec", "membound_vs_gemm", "--vary", "gemm=16..32:16", "--plot", "/nonexistent/p.png"], "--plot"),
    ],
)
def test_a_chart_path_is_checked_before_the_work_too(capsys, no_gpu, argv, option):
    line = one_line(capsys, cli.main(argv))
    assert f"{option} /nonexistent/p.png: directory /nonexistent does not exist" in line


def test_an_output_that_is_a_directory_is_refused(capsys, no_gpu, tmp_path):
    line = one_line(capsys, cli.main(["bench", "moe", "-o", str(tmp_path)]))
    assert line == f"megamoe-rt bench moe: -o/--output {tmp_path}: is a directory"


def test_bench_moe_with_a_missing_output_directory_as_a_user_runs_it(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "bench", "moe", "-o", MISSING],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and out.stderr.splitlines() == [
        f"megamoe-rt bench moe: -o/--output {MISSING}: directory /nonexistent does not exist"
    ]


def test_the_module_entry_points_check_their_output_first(capsys, no_gpu, monkeypatch):
    import megamoe_rt.ep.launch as launch
    from megamoe_rt.cli import bench_ep, faults, trace, tune_split

    monkeypatch.setattr(launch, "context_from_env", _gpu_probed)
    assert "-o/--output" in one_line(capsys, tune_split.main(["--tokens", "64", "-o", MISSING]))
    assert "-o/--output" in one_line(capsys, trace.main(["-o", MISSING]))
    for what in ("moe", "prefill"):
        with pytest.raises(SystemExit) as exit_:
            bench_ep.main_ep(["-o", MISSING], what)
        assert "-o/--output" in one_line(capsys, exit_.value.code)
    with pytest.raises(SystemExit) as exit_:
        bench_ep.main_ep(["--png", "/nonexistent/p.png"], "prefill")
    assert "--png /nonexistent/p.png" in one_line(capsys, exit_.value.code)
    monkeypatch.setattr(faults, "run_fault", _gpu_probed)
    for argv in (["-o", MISSING], ["--md", "/nonexistent/f.md"]):
        with pytest.raises(SystemExit) as exit_:
            faults.main(argv)
        assert "/nonexistent" in one_line(capsys, exit_.value.code)


# --- matplotlib, checked before the work --------------------------------------------------------


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setattr(plotting, "matplotlib_available", lambda: False)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["sweep", "--spec", "membound_vs_gemm", "--vary", "gemm=16..32:16", "--plot", "s.png"], "--plot"),
        (["tune-split", "--tokens", "64", "--png", "s.png"], "--png"),
        (["bench", "prefill", "--png", "p.png"], "--png"),
    ],
)
def test_a_chart_without_matplotlib_stops_before_any_gpu_work(capsys, no_gpu, no_matplotlib, argv, option):
    line = one_line(capsys, cli.main(argv), expected=1)
    assert line.startswith(f"megamoe-rt {argv[0]}") and option in line and PLOT_INSTALL in line, line


def test_a_chart_across_ranks_without_matplotlib_stops_before_joining_the_group(
    capsys, no_gpu, no_matplotlib, monkeypatch
):
    import megamoe_rt.ep.launch as launch
    from megamoe_rt.cli import bench_ep, tune_split

    monkeypatch.setattr(launch, "context_from_env", _gpu_probed)
    monkeypatch.setattr(launch, "launch_script", _gpu_probed)
    assert PLOT_INSTALL in one_line(capsys, bench_ep.main_ep(["--png", "p.png"], "prefill"), expected=1)
    line = one_line(capsys, tune_split.main(["--tokens", "64", "--ranks", "2", "--png", "p.png"]), expected=1)
    assert PLOT_INSTALL in line


def test_without_a_chart_option_matplotlib_is_not_needed(monkeypatch, no_matplotlib, capsys):
    import megamoe_rt.cli.bench_prefill as bench_prefill

    monkeypatch.setattr(commands, "hopper_or_none", lambda command: H200)
    monkeypatch.setattr(bench_prefill, "bench_prefill", lambda *a, **kw: [])
    assert cli.main(["bench", "prefill"]) == 0
