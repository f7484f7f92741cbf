"""The examples run as written on a Hopper GPU."""

from __future__ import annotations

import os
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


@pytest.mark.gpu
def test_jax_interop_runs_on_a_hopper_gpu():
    pytest.importorskip("jax")
    out = _run("jax_interop")
    assert out.returncode == 0, out.stderr
    assert "calc_diff vs reference" in out.stdout and "bfloat16" in out.stdout, out.stdout


@pytest.mark.gpu
def test_split_partitions_example_runs_and_every_split_is_bitwise_fused():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "split_partitions.py"), "--tokens", "1024", "--splits", "64,88"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith(("64 ", "88 "))]
    assert len(rows) == 2 and all(r.rstrip().endswith("True") for r in rows), out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_prefill_example_runs_and_the_ring_is_bitwise_the_full_pool(mode):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "prefill.py"), "--tokens", "8192", "--mode", mode],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "bitwise equal: True" in out.stdout, out.stdout
    smaller = next(line for line in out.stdout.splitlines() if line.startswith("buffer x"))
    assert float(smaller.split()[1][1:]) > 1.0, out.stdout


@pytest.mark.gpu
def test_streaming_router_example_matches_the_batch_call_bitwise():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "streaming_router.py"), "--tokens", "1000", "--slots", "2", "--chunk", "128"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "streamed == batch, bitwise: True" in out.stdout, out.stdout
    assert "chunk logits == batch logits: True" in out.stdout, out.stdout
    assert "router's activations == quantize_fp8(hidden): True" in out.stdout, out.stdout


@pytest.mark.gpu
def test_quickstart_runs_on_a_hopper_gpu():
    out = _run("quickstart")
    assert out.returncode == 0, out.stderr
    assert "y (512, 2048) mean |y|" in out.stdout and "total" in out.stdout, out.stdout


@pytest.mark.gpu
def test_two_rank_example_runs_with_both_ranks_on_one_gpu():
    pytest.importorskip("nvshmem.core")
    env = {**os.environ, "MEGAMOE_RT_RANK_DEVICES": "0"}  # both ranks on GPU 0: correctness, not timing
    out = subprocess.run(
        [sys.executable, "-m", "megamoe_rt", "launch", "-n", "2", str(EXAMPLES / "two_rank_ep.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"rank {rank}: "))
        assert "fused vs unfused max |diff| 0.00e+00" in line, out.stdout  # the modes are bitwise equal
