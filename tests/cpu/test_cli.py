"""The `megamoe-rt` commands that need no GPU, run as a user would run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megamoe_rt.schedule.layout import symm_buffer_layout
from tests.helpers.base_install import run_base
from tests.helpers.one_line import INSTALL, the_one_line


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megamoe_rt", *args], capture_output=True, text=True, timeout=600)


def test_plan_prints_region_table_for_pro():
    out = run_cli("plan", "--preset", "pro", "--tokens", "8192", "--ranks", "8")
    assert out.returncode == 0, out.stderr
    layout = symm_buffer_layout(7168, 3072, 384, 6, 8192, 8)
    for name, _nbytes, mib in layout.report():
        line = next(l for l in out.stdout.splitlines() if l.split() and l.split()[0] == name)
        assert f"{mib:.2f}" in line
    assert f"{layout.total_bytes / 2**20:.2f}" in out.stdout
    assert "48 per rank" in out.stdout


def test_plan_json_matches_layout():
    out = run_cli("plan", "--preset", "flash", "--tokens", "2048", "--ranks", "8", "--pool", "ring", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    layout = symm_buffer_layout(4096, 2048, 256, 6, 2048, 8, pool="ring")
    assert data["total_bytes"] == layout.total_bytes
    assert data["pool_blocks"] == layout.pool_blocks
    assert data["fused_lag_units"] == 14
    assert [r["name"] for r in data["regions"]] == [r[0] for r in layout.report()]


def test_plan_of_the_fused_mode_shows_its_ring_buffer():
    out = run_cli("plan", "--preset", "flash", "--tokens", "8192", "--ranks", "8", "--mode", "fused", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    layout = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8, block_m=64, pool="ring")
    full = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8)
    assert (data["block_m"], data["pool"], data["total_bytes"]) == (64, "ring", layout.total_bytes)
    assert data["fused_ring_blocks"] == data["pool_blocks"] == 8 * (data["fused_lag_units"] + 4) + 4
    # The EP8 buffer of the fused mode is over 4x smaller than the unfused mode's full pool buffer.
    assert full.total_bytes > 4 * layout.total_bytes


def test_compile_all_json_reports_quantizer_without_spills():
    out = run_cli("compile", "--all", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    names = {r["name"] for r in rows}
    assert {"quantize_fp8_1x128[bf16]", "quantize_fp8_1x128[float32]"} <= names
    for r in rows:
        assert {"name", "registers", "spill_bytes", "smem_bytes"} <= set(r)
        assert r["spill_bytes"] == 0 and r["registers"] > 0
    again = json.loads(run_cli("compile", "--all", "--json").stdout)
    assert all(r["from_cache"] for r in again)


def test_info_runs_without_gpu():
    out = run_cli("info")
    assert out.returncode == 0, out.stderr
    assert "megamoe_rt" in out.stdout and "nvrtc" in out.stdout and "cache" in out.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("plan", "--preset", "nope"),
        ("plan", "--tokens", "0"),
        ("plan", "--tokens", "abc"),
        ("plan", "--ranks", "3"),
        ("plan", "--block-m", "96"),
        ("compile",),
        ("compile", "no_such_kernel"),
        ("frobnicate",),
        ("launch", "-n", "0", "x.py"),
        ("launch", "-n", "2", "--timeout", "-1", "x.py"),
        ("launch", "-n", "2", "--timeout", "nan", "x.py"),
        ("launch", "-n", "2", "--timeout", "inf", "x.py"),
        ("tune-split", "--preset", "nosuch", "--tokens", "64"),
        ("tune-split", "--preset", "flash"),
        ("tune-split", "--preset", "flash", "--tokens", "x"),
        (),
    ],
)
def test_invalid_arguments_exit_2_with_one_line(args):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_bench_module_forwards_to_the_cli_outside_a_launch():
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt.cli.bench", "moe", "--preset", "nosuch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "nosuch" in out.stderr  # the CLI's own argument check


def test_tune_split_without_a_hopper_gpu_says_why(monkeypatch, capsys):
    import megamoe_rt.cli.commands as commands
    import megamoe_rt.cli.main as cli

    monkeypatch.setattr(commands, "hopper_or_none", lambda command: print(f"megamoe-rt {command}: no GPU") or None)
    assert cli.main(["tune-split", "--preset", "flash", "--tokens", "64"]) == 1
    assert "megamoe-rt tune-split: no GPU" in capsys.readouterr().out


def test_tune_split_rebuilds_its_arguments_for_the_ranks_it_launches():
    import argparse

    from megamoe_rt.cli.tune_split import _argv, add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    argv = ["--preset", "v3", "--tokens", "512", "--ranks", "2", "--step", "16", "--png", "a.png", "--no-store"]
    argv += ["--json", "-o", "a.json"]
    a = ap.parse_args(argv)
    assert ap.parse_args(_argv(a)) == a


GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def test_sweep_without_vary_runs_the_spec_once(monkeypatch, capsys):
    import megamoe_rt.cli.commands as commands
    import megamoe_rt.cli.main as cli
    import megamoe_rt.graph.sweep as sweep
    from megamoe_rt.graph import load_spec
    from megamoe_rt.graph.workloads import KNOWN

    calls = []

    def fake_run_sweep(spec, vary, values, *, device, reps):
        calls.append((spec.name, vary, values, device, reps))
        return [
            {
                "value": None,
                "partitions": {"gemm": 64, "copy": 64},
                "nodes_us": {"gemm": 10.0, "copy": 20.0},
                "total_us": 25.0,
            }
        ]

    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(
        commands, "hopper_or_none", lambda command: SimpleNamespace(ordinal=0, name="H200", sm_count=132)
    )
    spec_path = str(GRAPHS / "membound_vs_gemm.toml")
    assert cli.main(["sweep", "--spec", spec_path, "--reps", "3"]) == 0
    assert calls == [("membound_vs_gemm", None, None, 0, 3)]
    out = capsys.readouterr().out
    assert "partitions as specified" in out and "spec" in out.splitlines()[-1]
    # The single point is the spec's own partitions.
    spec = load_spec(spec_path, known_kernels=KNOWN)
    assert sweep.sweep_points(spec, None, None) == [(None, list(spec.partitions))]
    assert [v for v, _ in sweep.sweep_points(spec, "gemm", [16, 32])] == [16, 32]


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--plot", "sweep.png"), "--plot needs --vary"),
        (("--vary", "nope=8..16"), "--vary names partition 'nope'"),
        (("--vary", "gemm=16"), "expected NAME=START..STOP"),
    ],
)
def test_sweep_argument_errors_exit_2_before_any_gpu_work(extra, message):
    out = run_cli("sweep", "--spec", str(GRAPHS / "membound_vs_gemm.toml"), *extra)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["bench", "stream"], (["flash", "v3"], [512, 2048, 8192], 4, 512)),
        (
            ["bench", "stream", "--preset", "pro", "--tokens", "4096", "--slots", "3", "--chunk", "256"],
            (["pro"], [4096], 3, 256),
        ),
    ],
)
def test_bench_stream_passes_its_options_and_defaults(monkeypatch, argv, expected):
    import megamoe_rt.cli.bench_stream as bench_stream
    import megamoe_rt.cli.commands as commands
    import megamoe_rt.cli.main as cli

    seen = {}
    info = SimpleNamespace(ordinal=0, name="H200", sm_count=132)
    monkeypatch.setattr(commands, "hopper_or_none", lambda command: info)
    monkeypatch.setattr(
        bench_stream,
        "bench_stream",
        lambda presets, tokens, **kw: seen.update(args=(presets, tokens, kw["slots"], kw["chunk"])),
    )
    assert cli.main(argv) == 0
    assert seen["args"] == expected


def test_bench_stream_rejects_a_zero_chunk():
    out = run_cli("bench", "stream", "--chunk", "0")
    assert out.returncode == 2 and "--chunk" in out.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (("--ranks", "7"), "megamoe-rt plan: --ranks 7 does not divide the flash preset's 256 experts"),
        (("--experts", "100", "--ranks", "8"), "megamoe-rt plan: --ranks 8 does not divide --experts 100"),
        (("--experts", "4", "--ranks", "4"), "megamoe-rt plan: --experts 4 is fewer than the flash preset's top-6"),
    ],
)
def test_plan_says_what_does_not_fit_in_the_options_typed(args, message):
    out = run_cli("plan", *args)
    assert out.returncode == 2 and out.stderr.startswith(message), out.stderr
    assert "num_experts" not in out.stderr and "num_ranks" not in out.stderr  # the planner's own names


# Every command that needs a GPU, as the user starts it: megamoe-rt COMMAND, the modules behind
# the commands, and the launcher running them as ranks.
GPU_COMMANDS = [
    ("-m", "megamoe_rt", "partitions"),
    ("-m", "megamoe_rt", "demo"),
    ("-m", "megamoe_rt", "bench", "moe"),
    ("-m", "megamoe_rt", "sweep", "--spec", str(GRAPHS / "membound_vs_gemm.toml")),
    ("-m", "megamoe_rt", "tune-split", "--preset", "flash", "--tokens", "64"),
    ("-m", "megamoe_rt", "trace"),
    ("-m", "megamoe_rt.cli.faults"),
    ("-m", "megamoe_rt.cli.bench", "gemm"),
    ("-m", "megamoe_rt.cli.tune_split", "--preset", "flash", "--tokens", "64"),
    ("-m", "megamoe_rt.cli.trace"),
    ("-m", "megamoe_rt", "launch", "-n", "2", "-m", "megamoe_rt.cli.bench", "moe"),
    ("-m", "megamoe_rt", "launch", "-n", "2", "-m", "megamoe_rt.cli.trace"),
]


def _what(argv) -> str:
    return " ".join(a for a in argv if a != "-m")


@pytest.mark.parametrize("argv", GPU_COMMANDS, ids=_what)
def test_gpu_command_without_a_hopper_gpu_says_so_in_one_line(argv, tmp_path):
    from tests.conftest import hopper_gpu_count

    if hopper_gpu_count():
        pytest.skip("a Hopper GPU is present: the command runs")
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    line = the_one_line(_what(argv), out)
    assert "sm_90" in line, line  # no driver, no device or another GPU: the line names the one needed


@pytest.mark.parametrize("argv", [*GPU_COMMANDS, ("-m", "megamoe_rt", "compile", "--all")], ids=_what)
def test_command_without_the_cu13_extra_names_it_and_the_install_command(argv, base_install_python, tmp_path):
    line = the_one_line(_what(argv), run_base(base_install_python, list(argv), tmp_path))
    assert INSTALL in line, line
    assert ("NVRTC" if "compile" in argv else "CuPy") in line, line


@pytest.mark.parametrize("args", [("plan", "--preset", "pro"), ("scaleout",), ("info",)])
def test_commands_that_need_no_gpu_work_without_the_cu13_extra(args, base_install_python, tmp_path):
    out = run_base(base_install_python, ["-m", "megamoe_rt", *args], tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
