"""The README's commands and Python example succeed on a Hopper GPU, run as written."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.readme import as_argv, readme_blocks, readme_commands, run


@pytest.mark.gpu
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_succeeds_on_a_hopper_gpu(command, tmp_path):
    out = run(as_argv(command), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.gpu
def test_readme_python_example_computes_y_on_a_hopper_gpu(tmp_path):
    (example,) = readme_blocks("python")
    # The example's own names, checked after it ran: y is the layer's bf16 output of every token.
    check = "\nassert y.shape == (T, H) and str(y.dtype) == 'uint16'\nprint('readme-example-ok')\n"
    out = run([sys.executable, "-c", example + check], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "readme-example-ok" in out.stdout
