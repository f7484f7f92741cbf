"""The examples run as written on a Hopper GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True, text=True, timeout=600)


@pytest.mark.gpu
def test_torch_interop_runs_on_a_hopper_gpu():
    pytest.importorskip("torch")
    out = _run("torch_interop")
    assert out.returncode == 0, out.stderr
    assert "calc_diff vs reference" in out.stdout
