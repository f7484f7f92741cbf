"""Driver-layer behaviour that can be checked on any machine."""

from __future__ import annotations

import pytest

from megamoe_rt import CudaError, GpuUnavailableError
from megamoe_rt.runtime import driver
from megamoe_rt.runtime.errors import NvrtcError


def test_cuda_error_carries_call_and_result():
    e = CudaError("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", 2)
    assert e.call == "cuMemAlloc" and e.result == "CUDA_ERROR_OUT_OF_MEMORY" and e.code == 2
    assert "cuMemAlloc" in str(e) and "CUDA_ERROR_OUT_OF_MEMORY" in str(e)
    assert isinstance(e, RuntimeError)


def test_call_raises_cuda_error_from_failing_result():
    from cuda.bindings import driver as cu

    def cuFake(*_):
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE, None)

    with pytest.raises(CudaError) as info:
        driver.call(cuFake)
    assert info.value.call == "cuFake" and info.value.result == "CUDA_ERROR_INVALID_VALUE"


def test_call_unwraps_values():
    from cuda.bindings import driver as cu

    ok = cu.CUresult.CUDA_SUCCESS
    assert driver.call(lambda: (ok,)) is None
    assert driver.call(lambda: (ok, 5)) == 5
    assert driver.call(lambda: (ok, 1, 2)) == (1, 2)


def test_nvrtc_error_keeps_log():
    e = NvrtcError("nvrtcCompileProgram", "NVRTC_ERROR_COMPILATION", "x.cu(1): error: bad", "x.cu")
    assert e.log.startswith("x.cu(1)") and "x.cu(1): error: bad" in str(e)


def test_gpu_entry_points_raise_one_line_without_a_hopper_gpu():
    from conftest import hopper_gpu_count

    if hopper_gpu_count():
        pytest.skip("a Hopper GPU is present")
    with pytest.raises(GpuUnavailableError) as info:
        driver.require_hopper()
    msg = str(info.value)
    assert "\n" not in msg and ("sm_90" in msg or "Hopper" in msg)
    assert isinstance(info.value, RuntimeError)


def test_quantize_without_gpu_raises_before_anything_else():
    from conftest import hopper_gpu_count

    import megamoe_rt

    if hopper_gpu_count():
        pytest.skip("a Hopper GPU is present")

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4, 256), "typestr": "<u2", "data": (4096, False), "version": 3}

    with pytest.raises(RuntimeError) as info:
        megamoe_rt.quantize_fp8(FakeCuda())
    assert "\n" not in str(info.value)


class _Handle:
    def __init__(self, h):
        self._h = h

    def __cuda_stream__(self):
        return (0, self._h)


def test_stream_handle_accepts_common_forms():
    assert driver.stream_handle(0) == 0
    assert driver.stream_handle(1234) == 1234
    assert driver.stream_handle(_Handle(77)) == 77

    class CupyLike:
        ptr = 99

    assert driver.stream_handle(CupyLike()) == 99
    with pytest.raises(TypeError, match="stream"):
        driver.stream_handle("not a stream")
