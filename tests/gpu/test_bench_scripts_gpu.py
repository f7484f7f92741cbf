"""The profiling scripts under bench/ run against the current internals they hook into."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.gpu
def test_stream_timeline_marks_every_stage_of_every_call():
    calls = 2
    out = subprocess.run(
        [sys.executable, str(BENCH / "stream_timeline.py"), "flash", "1024", "256", "2", str(calls)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    labels = [line.split(":")[0].strip() for line in out.stdout.splitlines() if line.startswith("  ")]
    for stage in ("consume", "seal", "L1 GEMM", "L2 GEMM", "combine"):
        assert labels.count(stage) == calls, (stage, out.stdout)
    # 1024 tokens in chunks of 256: four chunks published per call.
    assert sum("published" in label for label in labels) >= calls, out.stdout
    assert "router alone" in out.stdout, out.stdout
