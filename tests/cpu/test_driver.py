"""Driver-layer behaviour that can be checked on any machine."""

from __future__ import annotations

import pytest
from helpers.streams import TorchLikeStream

from megamoe_rt import CudaError, GpuUnavailableError
from megamoe_rt.runtime import device_memory, devices, driver, streams
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
        devices.require_hopper()
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
    """A cuda.core-style stream: ``__cuda_stream__()`` returns (version, handle)."""

    def __init__(self, h, version=0):
        self._h, self._v = h, version

    def __cuda_stream__(self):
        return (self._v, self._h)


class _OldProtocol:
    """Early cuda.core: ``__cuda_stream__`` as an attribute holding the tuple."""

    __cuda_stream__ = (0, 55)


class _CupyLike:
    ptr = 99


def test_stream_handle_accepts_common_forms():
    assert streams.stream_handle(0) == 0
    assert streams.stream_handle(1234) == 1234
    assert streams.stream_handle(_Handle(77)) == 77
    assert streams.stream_handle(_CupyLike()) == 99
    with pytest.raises(TypeError, match="stream"):
        streams.stream_handle("not a stream")


def test_stream_handle_accepts_pytorch_cuda_core_and_bindings_streams():
    import numpy as np
    from cuda.bindings import driver as cu

    core = pytest.importorskip("cuda.core")
    assert streams.stream_handle(TorchLikeStream(0x7F00)) == 0x7F00
    assert streams.stream_handle(TorchLikeStream(0)) == 0  # torch's default stream
    assert streams.stream_handle(_OldProtocol()) == 55
    # Real cuda.core objects: wrapping a foreign handle needs no GPU.
    assert streams.stream_handle(core.Stream.from_handle(0x1234)) == 0x1234
    assert streams.stream_handle(core.LEGACY_DEFAULT_STREAM) == 1
    assert streams.stream_handle(cu.CUstream(0x42)) == 0x42
    assert streams.stream_handle(np.uint64(0x43)) == 0x43


def test_stream_handle_prefers_the_protocol_over_attributes():
    class Both(TorchLikeStream):
        ptr = 3

        def __cuda_stream__(self):
            return (0, 11)

    assert streams.stream_handle(Both(7)) == 11


def test_stream_handle_for_our_own_stream_needs_no_driver_call():
    s = object.__new__(streams.Stream)
    s._handle = 0x5000
    assert streams.stream_handle(s) == 0x5000 and s.__cuda_stream__() == (0, 0x5000)
    s._handle = None  # closed
    with pytest.raises(ValueError, match="closed"):
        streams.stream_handle(s)


def test_stream_handle_none_is_cupys_current_stream_or_the_default(monkeypatch):
    import sys
    import types

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert streams.stream_handle(None) == 0
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: _CupyLike()))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert streams.stream_handle(None) == 99


def test_stream_handle_rejects_what_is_not_a_stream():
    with pytest.raises(TypeError, match="bool"):
        streams.stream_handle(True)
    with pytest.raises(ValueError, match="non-negative"):
        streams.stream_handle(-1)
    with pytest.raises(TypeError, match="protocol version 1"):
        streams.stream_handle(_Handle(5, version=1))

    class Broken:
        def __cuda_stream__(self):
            return 5

    with pytest.raises(TypeError, match=r"Broken.__cuda_stream__ gave 5"):
        streams.stream_handle(Broken())


def test_core_stream_wraps_any_stream_without_a_gpu():
    core = pytest.importorskip("cuda.core")
    s = core.Stream.from_handle(0x1234)
    assert streams.core_stream(s) is s
    assert streams.core_stream(0) is core.LEGACY_DEFAULT_STREAM
    assert streams.core_stream(1) is core.LEGACY_DEFAULT_STREAM
    assert streams.core_stream(2) is core.PER_THREAD_DEFAULT_STREAM
    wrapped = streams.core_stream(TorchLikeStream(0x9000))
    assert isinstance(wrapped, core.Stream) and wrapped.__cuda_stream__() == (0, 0x9000)


def _core_cuda_error():
    try:
        from cuda.core._utils.cuda_utils import CUDAError
    except ImportError:  # the private path moved: a stand-in with the same name and package
        CUDAError = type("CUDAError", (Exception,), {"__module__": "cuda.core._utils.cuda_utils"})
    return CUDAError


def test_core_call_turns_cuda_core_errors_into_cuda_errors_naming_the_call():
    CUDAError = _core_cuda_error()

    def oom():
        raise CUDAError("CUDA_ERROR_OUT_OF_MEMORY: out of memory")

    with pytest.raises(CudaError) as info:
        driver.core_call("cuMemAllocFromPoolAsync", oom)
    e = info.value
    assert (e.call, e.result, e.code) == ("cuMemAllocFromPoolAsync", "CUDA_ERROR_OUT_OF_MEMORY", 2)
    assert "out of memory" in str(e) and "cuMemAllocFromPoolAsync failed" in str(e)

    def odd():
        raise CUDAError("Device 0 is not yet initialized")

    with pytest.raises(CudaError) as info:
        driver.core_call("cuStreamCreateWithPriority", odd)
    assert info.value.result == "CUDA_ERROR_UNKNOWN" and "not yet initialized" in str(info.value)


def test_core_call_names_the_call_on_explained_misuse_and_passes_the_rest():
    def unrecorded():
        raise RuntimeError("Both Events must be recorded before they can be subtracted")

    with pytest.raises(RuntimeError, match=r"^cuEventElapsedTime: Both Events"):
        driver.core_call("cuEventElapsedTime", unrecorded)
    ours = CudaError("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE", 400)

    def raise_ours():
        raise ours

    with pytest.raises(CudaError) as info:
        driver.core_call("cuEventRecord", raise_ours)
    assert info.value is ours
    with pytest.raises(ValueError, match="plain"):
        driver.core_call("x", lambda: (_ for _ in ()).throw(ValueError("plain")))
    assert driver.core_call("x", lambda a, b=0: a + b, 1, b=2) == 3


def test_a_kernel_fault_from_cuda_core_carries_the_timeout_record():
    CUDAError = _core_cuda_error()
    driver.register_fault_explainer(_explain_trap)
    try:

        def trapped():
            raise CUDAError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")

        with pytest.raises(CudaError) as info:
            driver.core_call("cuStreamSynchronize", trapped)
        assert info.value.code == 719 and "wait 'x' timed out" in str(info.value)
    finally:
        driver._fault_explainers.remove(_explain_trap)


def _explain_trap():
    return "wait 'x' timed out"


def test_too_old_cuda_core_is_a_one_line_error(monkeypatch):
    core = pytest.importorskip("cuda.core")
    monkeypatch.setattr(core, "__version__", "0.7.0")
    with pytest.raises(GpuUnavailableError, match=r"cuda-core 0.7.0 is too old") as info:
        driver.cuda_core()
    assert "\n" not in str(info.value)


def test_the_cuda_core_api_we_use_is_there():
    """Names and keywords driver.py uses, checked against the installed cuda.core (the GPU
    machines may run an older 1.2.x than this one)."""
    import dataclasses
    import importlib
    import inspect

    core = pytest.importorskip("cuda.core")
    for name in (
        "name",
        "compute_capability",
        "properties",
        "set_current",
        "create_stream",
        "create_event",
        "allocate",
        "device_id",
    ):
        assert hasattr(core.Device, name), name
    props = importlib.import_module("cuda.core._device").DeviceProperties
    for name in ("multiprocessor_count", "l2_cache_size", "max_shared_memory_per_block_optin", "clock_rate"):
        assert hasattr(props, name), name
    assert {f.name for f in dataclasses.fields(core.StreamOptions)} >= {"nonblocking", "priority"}
    assert {f.name for f in dataclasses.fields(core.EventOptions)} >= {"timing_enabled"}
    inspect.signature(core.Device.allocate).bind(None, 1, stream=None)
    inspect.signature(core.Device.create_stream).bind(None, options=None)
    inspect.signature(core.Device.create_event).bind(None, options=None)
    inspect.signature(core.Buffer.close).bind(None, None)
    for name in ("sync", "close", "handle", "from_handle", "__cuda_stream__"):
        assert hasattr(core.Stream, name), name
    for name in ("sync", "close", "handle", "is_done", "__sub__"):
        assert hasattr(core.Event, name), name
    assert hasattr(core.Buffer, "handle") and hasattr(core, "LEGACY_DEFAULT_STREAM")


def test_owned_streams_events_and_memory_need_a_gpu_and_say_so_in_one_line():
    from conftest import hopper_gpu_count

    if hopper_gpu_count():
        pytest.skip("a GPU is present")
    for make in (streams.Stream, streams.Event, lambda: device_memory.DeviceMemory(16)):
        with pytest.raises(GpuUnavailableError) as info:
            make()
        assert "\n" not in str(info.value)


class _FakeDriver:
    """cuCtx* of a thread whose current context is ctx0 on GPU 0; primary contexts ctxN."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self):
        self.current, self.current_device, self.set = "ctx0", 0, []

    def cuCtxGetCurrent(self):
        return 0, self.current

    def cuCtxGetDevice(self):
        return 0, self.current_device

    def cuDeviceGet(self, ordinal):
        return 0, ordinal

    def cuDevicePrimaryCtxRetain(self, dev):
        return 0, f"primary{dev}"

    def cuCtxSetCurrent(self, ctx):
        self.set.append(ctx)
        return (0,)


def test_context_for_leaves_the_current_context_alone_and_ensure_context_switches_it(monkeypatch):
    from megamoe_rt.runtime import driver

    class Ctx(str):  # the driver's handles convert to int; these stand-ins name themselves
        def __int__(self):
            return 1

    fake = _FakeDriver()
    fake.current = Ctx("ctx0")
    monkeypatch.setattr(driver, "cuda_driver", lambda: fake)
    monkeypatch.setattr(driver, "_ensure_init", lambda: None)
    monkeypatch.setattr(driver, "_primary_ctx", {})
    assert driver.context_for(0) == "ctx0"  # the current context, on the GPU asked for
    assert driver.context_for(1) == "primary1" and fake.set == []  # nothing made current
    assert driver.ensure_context(0) == "ctx0" and fake.set == []
    assert driver.ensure_context(1) == "primary1" and fake.set == ["primary1"]
