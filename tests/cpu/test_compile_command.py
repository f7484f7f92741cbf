"""`megamoe-rt compile`: --list, unknown names, builds in worker processes with a progress line
per kernel, and Ctrl-C (NVRTC builds sm_90a cubins without a GPU)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamoe_rt.kernels.registry import all_kernel_specs

SMALL = ("quantize_fp8_1x128[bf16]", "sm_probe", "ep_begin")  # a fraction of a second each
PROGRESS = re.compile(r"^\[ *(\d+)/(\d+)\] (\S+)  (?:[\d.]+ s  \d+ regs  \d+ spill bytes|cached)$")
INTERRUPTED = "megamoe-rt compile: interrupted"


def run_compile(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGAMOE_RT_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "compile", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_list_prints_the_registry_one_name_a_line(tmp_path):
    out = run_compile(tmp_path, "--list")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [s.name for s in all_kernel_specs()]
    assert out.stderr == ""
    assert not list(tmp_path.iterdir())  # nothing compiled, nothing cached


@pytest.mark.parametrize(
    ("name", "near"),
    [
        ("quantize_fp8_1x128[bf61]", "quantize_fp8_1x128[bf16]"),
        ("fused_moe", "fused_moe[s4,asf64,int32]"),  # a family's prefix: its first variants
        ("nosuch", None),
    ],
)
def test_unknown_kernel_is_one_line_with_names_near_it(tmp_path, name, near):
    out = run_compile(tmp_path, "sm_probe", name)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    total = len(all_kernel_specs())
    assert lines[0].startswith(f"megamoe-rt compile: unknown kernel {name!r}")
    assert lines[0].endswith(f"(megamoe-rt compile --list shows all {total})")
    if near is None:
        assert "did you mean" not in lines[0]
    else:
        suggested = lines[0].split("did you mean: ")[1].split("? (")[0].split(", ")
        assert near in suggested and len(suggested) <= 3
    assert out.stdout == ""


def _progress(stderr: str, total: int) -> list[str]:
    """The kernel names of the progress lines, in the order they came; every line is one."""
    names = []
    for i, line in enumerate(stderr.splitlines(), 1):
        m = PROGRESS.match(line)
        assert m, line
        assert (int(m[1]), int(m[2])) == (i, total), line
        names.append(m[3])
    return names


def _without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "compile_seconds"} for r in rows]


def test_parallel_build_gives_the_serial_results_in_order_with_progress(tmp_path):
    serial = run_compile(tmp_path / "serial", "-j", "1", "--no-cache", "--json", *SMALL)
    parallel = run_compile(tmp_path / "parallel", "-j", "2", "--no-cache", "--json", *SMALL)
    for out in (serial, parallel):
        assert out.returncode == 0, out.stderr
        assert sorted(_progress(out.stderr, len(SMALL))) == sorted(SMALL)  # stderr: progress only
    rows = json.loads(parallel.stdout)  # stdout: the results only
    assert [r["name"] for r in rows] == list(SMALL)  # the order asked for, not the order finished
    assert not any(r["from_cache"] for r in rows)
    assert _without_times(rows) == _without_times(json.loads(serial.stdout))

    fill = run_compile(tmp_path / "cache", "-j", "2", *SMALL)  # --no-cache stores nothing: fill one
    assert fill.returncode == 0 and "cached" not in fill.stderr, fill.stderr
    again = run_compile(tmp_path / "cache", "-j", "2", *SMALL)  # the table, from the cache just filled
    assert again.returncode == 0, again.stderr
    assert all(line.endswith("  cached") for line in again.stderr.splitlines())
    assert sorted(_progress(again.stderr, len(SMALL))) == sorted(SMALL)
    table = [line.split()[0] for line in again.stdout.splitlines()[2:]]
    assert table == list(SMALL)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def _ignores_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(ignored >> (signal.SIGINT - 1) & 1)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads child processes from /proc")
def test_ctrl_c_ends_the_workers_with_one_line_and_status_130(tmp_path):
    env = {**os.environ, "MEGAMOE_RT_CACHE": str(tmp_path / "cache")}
    stdout = (tmp_path / "stdout").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megamoe_rt", "compile", "--all", "--no-cache", "-j", "2"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the SIGINT below reaches it as a Ctrl-C would
        # As from an interactive shell: a suite run in the background inherits SIGINT ignored,
        # and Python then installs no KeyboardInterrupt handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        first = proc.stderr.readline()  # the first kernel done: the workers are busy with the next ones
        assert PROGRESS.match(first.rstrip("\n")), first
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers
        deadline = time.monotonic() + 30  # a worker may still be starting: its initializer sets it
        while not all(_ignores_sigint(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_ignores_sigint(p) for p in workers)  # their own: only the parent reports a Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)  # to the parent and the workers alike
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = first + rest
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    progress = [line for line in lines if PROGRESS.match(line)]
    assert lines == [*progress, INTERRUPTED], stderr  # the progress lines, then one line
    assert len(progress) < len(all_kernel_specs())  # stopped before the end
    stdout.seek(0)
    assert stdout.read() == ""  # no results
    deadline = time.monotonic() + 10
    while any(_running(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _running(p)]
