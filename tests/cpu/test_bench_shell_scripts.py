"""The benchmark shell scripts under bench/: they parse, refuse an unknown stage, and every
benchmark command of bench/ep2_runs.sh is one the ranks' argument parser accepts (so the
script cannot drift from the command line it drives)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megamoe_rt.cli.bench_ep import ep_arguments

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.sh")))
def test_the_script_parses(script):
    subprocess.run(["bash", "-n", str(BENCH / script)], check=True)


def test_an_unknown_stage_is_refused_naming_the_stages(tmp_path):
    out = subprocess.run(
        ["bash", str(BENCH / "ep2_runs.sh"), "nope", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "unknown stage 'nope' (tests, overhead, stream, transport, prefill)" in out.stderr


def _launch_commands(text: str) -> list[list[str]]:
    """The arguments of every `launch WHAT ...` line (continuations joined, shell variables
    replaced by a path, the pipe to tee dropped)."""
    joined = text.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        m = re.match(r"\s*launch (.*?)\s*\|\s*tee", line)
        if m:
            commands.append(shlex.split(re.sub(r'"\$OUT/([^"]+)"', r"out/\1", m.group(1))))
    return commands


def test_every_benchmark_of_the_two_gpu_runs_parses():
    commands = _launch_commands((BENCH / "ep2_runs.sh").read_text())
    assert sorted(c[0] for c in commands) == ["moe", "overhead", "prefill", "stream"]
    for what, *argv in commands:
        ns = ep_arguments(argv, what)
        assert ns.output and ns.output.startswith("out/ep2_"), (what, argv)
    moe = next(c for c in commands if c[0] == "moe")
    assert ep_arguments(moe[1:], "moe").mode == ["unfused@nvlink", "unfused@nvshmem"]


def test_the_one_gpu_runs_refuse_an_unknown_stage_and_their_benchmarks_parse(tmp_path):
    script = BENCH / "one_gpu_runs.sh"
    out = subprocess.run(["bash", str(script), "nope", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert (
        out.returncode == 2
        and "unknown stage 'nope' (verify, verify-ep, gemm, gemm-first, tiles, prefill, overhead, faults, ab, arch-ab, "
        "stream, host)"
        in out.stderr
    )
    from megamoe_rt.cli.main import build_parser

    joined = script.read_text().replace("\\\n", " ").replace('"$sms"', "16")  # the stream stage's sweep
    commands = [
        shlex.split(re.sub(r'"\$OUT/([^"]+)"', r"out/\1", m.group(1)))
        for m in re.finditer(r"python3 -m megamoe_rt (bench .*?)\s*2>&1", joined)
    ]
    assert sorted(c[1] for c in commands) == ["gemm", "gemm", "overhead", "overhead", "prefill", "prefill", "stream"]
    for argv in commands:
        ns = build_parser().parse_args(argv)  # a bad option raises UsageError
        assert ns.output.startswith("out/one_gpu_"), argv
    # The A/B arms: bench/ab_run.sh appends `-o FILE` to what follows its output directory.
    ab = [shlex.split(m.group(1)) for m in re.finditer(r'bench/ab_run\.sh "\$OUT/[^"]+" (.*?)\s*2>&1', joined)]
    assert sorted(a[0] for a in ab) == ["gemm", "gemm", "moe", "moe", "overhead"]
    for argv in ab:
        assert build_parser().parse_args(["bench", *argv, "-o", "out/ab.json"]).output == "out/ab.json"
