"""Examples: a clear one-line exit where a requirement is missing (no Hopper GPU here, or no
cu13 extra: tests/helpers/base_install.py), their helpers checked on the CPU; the full runs are
tests/gpu/test_examples_gpu.py."""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megamoe_rt import reference as ref
from tests.helpers.base_install import run_base
from tests.helpers.one_line import INSTALL, the_one_line

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py"))
# Examples built on a framework besides megamoe_rt: without it they say so first.
FRAMEWORK = {"torch_interop": "torch", "jax_interop": "jax"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True, text=True, timeout=600)


def test_the_examples_are_found():
    assert {"quickstart", "two_rank_ep", "torch_interop", "jax_interop"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_example_without_a_hopper_gpu_ends_with_one_line(name):
    from tests.conftest import hopper_gpu_count

    framework = FRAMEWORK.get(name)
    if hopper_gpu_count() and (framework is None or importlib.util.find_spec(framework) is not None):
        pytest.skip("a Hopper GPU (and the example's framework) is present: the example runs (see the gpu tests)")
    line = the_one_line(name, _run(name))
    assert line.startswith(f"{name}: "), line
    if framework is None:  # no driver, no device, or not sm_90: each names the GPU it needs
        assert "sm_90" in line, line


@pytest.mark.parametrize("name", NAMES)
def test_example_without_the_cu13_extra_names_it_and_the_install_command(name, base_install_python, tmp_path):
    line = the_one_line(name, run_base(base_install_python, [str(EXAMPLES / f"{name}.py")], tmp_path))
    assert line.startswith(f"{name}: "), line
    if name not in FRAMEWORK:  # those first say that their framework is missing
        assert "CuPy" in line and INSTALL in line, line


def test_two_rank_example_under_the_launcher_says_it_once(base_install_python, tmp_path):
    from tests.conftest import hopper_gpu_count

    argv = ["-m", "megamoe_rt", "launch", "-n", "2", str(EXAMPLES / "two_rank_ep.py")]
    line = the_one_line("launch -n 2 two_rank_ep.py", run_base(base_install_python, argv, tmp_path))
    assert line.startswith("two_rank_ep: ") and INSTALL in line, line
    if not hopper_gpu_count():  # with a GPU the ranks get past the check
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
        line = the_one_line("launch -n 2 two_rank_ep.py", out)
        assert line.startswith("two_rank_ep: ") and "sm_90" in line, line


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


def test_jax_interop_quantizers_are_the_reference_recipe():
    jnp = pytest.importorskip("jax.numpy")
    example = _load("jax_interop")
    rng = np.random.default_rng(0)

    x = rng.standard_normal((6, 384), dtype=np.float32) * np.float32(3.0)
    x[2] = 0.0  # an all-zero row: the 1e-4 floor keeps its scale finite
    q, sf = example.quantize_rows(jnp.asarray(x))
    want_q, want_sf = ref.quantize_act_1x128(x)
    assert q.dtype == jnp.float8_e4m3fn and sf.dtype == jnp.float32
    assert np.array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert np.array_equal(np.asarray(sf), want_sf)

    w = rng.standard_normal((2, 256, 384), dtype=np.float32) / np.float32(16.0)
    q, sf = example.quantize_blocks(jnp.asarray(w))
    want_q, want_sf = ref.quantize_weight_128x128(w)
    assert np.array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert np.array_equal(np.asarray(sf), want_sf)


def _dl_tensor(capsule, name: bytes, offset: int = 0):
    """The DLTensor a DLPack capsule holds, read with the runtime's own struct."""
    from megamoe_rt.runtime.arrays import _DLTensor

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return _DLTensor.from_address(get(capsule, name) + offset)


def test_jax_interop_offers_bf16_bits_as_bfloat16_over_the_same_memory():
    example = _load("jax_interop")
    bits = (np.arange(12, dtype=np.float32).reshape(3, 4).view(np.uint32) >> 16).astype(np.uint16)
    capsule = example.Bfloat16Bits(bits).__dlpack__()  # kept: its deleter frees the tensor read below
    t = _dl_tensor(capsule, b"dltensor")
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (4, 16, 1)  # kDLBfloat
    assert t.data == bits.ctypes.data and [t.shape[i] for i in range(t.ndim)] == [3, 4]
    with pytest.raises(TypeError, match="bf16 bits"):
        example.Bfloat16Bits(np.zeros(3, np.float32)).__dlpack__()


def test_jax_interop_relabels_a_versioned_dlpack_capsule_too():
    example = _load("jax_interop")
    bits = np.zeros((2, 8), np.uint16)
    try:
        capsule = example.Bfloat16Bits(bits).__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip("this NumPy makes no DLPack 1.x capsules")
    # dlpack.h: DLManagedTensorVersioned holds its version (2 x uint32), manager context, deleter
    # and flags (uint64) before the tensor.
    t = _dl_tensor(capsule, b"dltensor_versioned", offset=32)
    assert (t.dtype.code, t.dtype.bits, t.data) == (4, 16, bits.ctypes.data)


def test_jax_interop_output_reaches_jax_as_bfloat16_without_a_copy():
    jax = pytest.importorskip("jax")
    example = _load("jax_interop")
    values = np.array([[1.0, -2.5, 0.0, 7.0], [3.0, 0.125, -0.0, -1.0]], dtype=np.float32)  # exact in bf16
    # XLA takes host memory without a copy only where it is 64-byte aligned, as device memory is.
    raw = np.zeros(values.size + 32, np.uint16)
    start = (-raw.ctypes.data % 64) // 2
    bits = raw[start : start + values.size].reshape(values.shape)
    bits[...] = values.view(np.uint32) >> 16
    y = jax.dlpack.from_dlpack(example.Bfloat16Bits(bits))
    assert y.dtype == jax.numpy.dtype(jax.numpy.bfloat16)
    assert y.unsafe_buffer_pointer() == bits.ctypes.data  # the same memory
    assert np.array_equal(np.asarray(y.astype(jax.numpy.float32)), values)
