"""The README's commands and its Python example, run as written, so the README cannot drift.

Without a Hopper GPU a command either works (those that need no GPU) or ends with one line
saying what is missing, exit status 1, never a traceback; so does the Python example, which
calls megamoe_rt.require_gpu() first. tests/gpu/test_readme_gpu.py runs the same commands and
the example where a Hopper GPU is present and expects each to succeed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.readme import as_argv, readme_blocks, readme_commands, run


def assert_works_or_says_why_in_one_line(what: str, out: subprocess.CompletedProcess) -> None:
    text = out.stdout + out.stderr
    assert "Traceback" not in text, f"{what}: a traceback\n{text}"
    if out.returncode == 0:
        return
    assert out.returncode == 1, f"{what}: exit {out.returncode}\n{text}"
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"{what}: {len(lines)} lines where one says what is missing\n{text}"


def test_the_readme_has_its_main_command_and_an_example():
    commands = readme_commands()
    assert any(c.startswith("megamoe-rt demo") for c in commands)
    (example,) = readme_blocks("python")
    assert "MegaMoE(" in example and len(example.strip().splitlines()) <= 14


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_works_or_says_why_without_a_hopper_gpu(command, tmp_path):
    from tests.conftest import hopper_gpu_count

    if hopper_gpu_count():
        pytest.skip("a Hopper GPU is present: tests/gpu/test_readme_gpu.py runs the command")
    assert_works_or_says_why_in_one_line(command, run(as_argv(command), tmp_path))


def test_readme_python_example_says_why_in_one_line_without_a_hopper_gpu(tmp_path):
    from tests.conftest import hopper_gpu_count

    if hopper_gpu_count():
        pytest.skip("a Hopper GPU is present: tests/gpu/test_readme_gpu.py runs the example")
    (example,) = readme_blocks("python")
    out = run([sys.executable, "-c", example], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert_works_or_says_why_in_one_line("the README's Python example", out)
    assert "sm_90" in out.stderr, out.stderr
