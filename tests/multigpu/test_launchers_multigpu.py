"""The two-rank example started by the launchers users already have (torchrun here; srun has no
scheduler on the test machines): the ranks meet through rank 0's hub (megamoe_rt/ep/rendezvous.py),
NVSHMEM bootstraps, and fused and unfused agree bit for bit across ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TEST_RANKS as WORLD

pytestmark = pytest.mark.multigpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_rank_ep.py"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun (PyTorch)")
def test_the_two_rank_example_under_torchrun(tmp_path):
    launched = {"MEGAMOE_RT_RANK", "MEGAMOE_RT_WORLD_SIZE", "MEGAMOE_RT_HUB", "MEGAMOE_RT_HUB_KEY"}
    env = {k: v for k, v in os.environ.items() if k not in launched}  # not a rank of an outer launch
    env["MEGAMOE_RT_RENDEZVOUS_DIR"] = str(tmp_path / "rdzv")
    cmd = [shutil.which("torchrun") or "torchrun", "--standalone", f"--nproc-per-node={WORLD}", str(EXAMPLE)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    lines = [line for line in out.stdout.splitlines() if "fused vs unfused max |diff|" in line]
    assert len(lines) == WORLD, text
    assert all(line.endswith("0.00e+00") for line in lines), text
