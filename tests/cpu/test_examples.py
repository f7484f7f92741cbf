"""Examples: a clear one-line exit where a requirement is missing, their helpers checked on the
CPU, and a full run on a Hopper GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megamoe_rt import reference as ref

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True, text=True, timeout=600)


def test_torch_interop_exits_with_one_line_without_torch_or_a_hopper_gpu():
    from tests.conftest import hopper_gpu_count

    if hopper_gpu_count() and importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch and a Hopper GPU are present: the example runs (see the gpu test)")
    out = _run("torch_interop")
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("torch_interop: "), out.stderr


def test_torch_interop_quantizers_are_the_reference_recipe():
    torch = pytest.importorskip("torch")
    example = _load("torch_interop")
    rng = np.random.default_rng(0)

    x = rng.standard_normal((6, 384), dtype=np.float32) * np.float32(3.0)
    x[2] = 0.0  # an all-zero row: the 1e-4 floor keeps its scale finite
    q, sf = example.quantize_rows(torch.from_numpy(x))
    want_q, want_sf = ref.quantize_act_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and sf.dtype == torch.float32
    assert np.array_equal(example.host(q).view(np.uint8), want_q.view(np.uint8))
    assert np.array_equal(sf.numpy(), want_sf)

    w = rng.standard_normal((2, 256, 384), dtype=np.float32) / np.float32(16.0)
    q, sf = example.quantize_blocks(torch.from_numpy(w))
    want_q, want_sf = ref.quantize_weight_128x128(w)
    assert np.array_equal(example.host(q).view(np.uint8), want_q.view(np.uint8))
    assert np.array_equal(sf.numpy(), want_sf)
