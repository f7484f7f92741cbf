"""Driver-layer behaviour on a Hopper GPU: what cuda.core does for the driver layer."""

from __future__ import annotations

import pytest
from helpers.streams import TorchLikeStream

from megamoe_rt import CudaError
from megamoe_rt.runtime import device_memory, devices, driver, streams

# --- on a GPU: what cuda.core now does for the driver layer ----------------------------------


@pytest.mark.gpu
def test_device_info_matches_the_driver_attributes():
    from cuda.bindings import driver as cu

    info = devices.device_info(0)
    dev = driver.call(cu.cuDeviceGet, 0)
    attr = cu.CUdevice_attribute

    def get(a):
        return int(driver.call(cu.cuDeviceGetAttribute, a, dev))

    assert info.compute_capability == (
        get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    )
    assert info.sm_count == get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    assert info.l2_cache_bytes == get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
    assert info.max_smem_per_block_optin == get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    assert info.clock_khz == get(attr.CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
    raw = driver.call(cu.cuDeviceGetName, 256, dev).split(b"\0", 1)[0].decode()
    assert info.name == raw and info.is_hopper and info.total_memory_bytes > 0


@pytest.mark.gpu
def test_owned_stream_event_and_memory():
    core = pytest.importorskip("cuda.core")
    s = streams.Stream()
    assert isinstance(s.handle, int) and s.handle not in (0, 1, 2)
    assert streams.stream_handle(s) == s.handle and streams.core_stream(s) is s.core
    assert isinstance(s.core, core.Stream) and s.core.is_nonblocking
    mem = device_memory.DeviceMemory(4096)
    mem.copy_from_host(bytes(range(256)) * 16)
    start, end = streams.Event().record(s), streams.Event()
    mem.memset_u8(0xAB, stream=s, nbytes=128, offset=256)
    end.record(s)
    end.synchronize()
    assert end.done and start.elapsed_ms(end) >= 0.0
    out = mem.copy_to_host()
    assert out[:256] == bytes(range(256)) and out[256:384] == b"\xab" * 128 and out[384:512] == bytes(range(128, 256))
    mem.free()
    with pytest.raises(ValueError, match="freed"):
        mem.ptr  # noqa: B018
    ordered = device_memory.DeviceMemory(64, stream=s)
    ordered.memset_u8(1, stream=s)
    s.synchronize()
    assert ordered.copy_to_host() == b"\x01" * 64
    ordered.free()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        streams.stream_handle(s)


@pytest.mark.gpu
def test_elapsed_time_of_an_unrecorded_event_names_the_call():
    a, b = streams.Event(), streams.Event()
    with pytest.raises((RuntimeError, CudaError), match="cuEventElapsedTime"):
        a.elapsed_ms(b)


@pytest.mark.gpu
def test_kernels_launch_on_every_kind_of_stream():
    cp = pytest.importorskip("cupy")
    core = pytest.importorskip("cuda.core")
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import SPEC, SmProbeParams

    k = get_kernel(SPEC, 0)
    cps = cp.cuda.Stream(non_blocking=True)
    ours = streams.Stream()
    kinds = {
        "int": cps.ptr,
        "cupy": cps,
        "torch-like": TorchLikeStream(cps.ptr),
        "cuda.core": ours.core,
        "wrapped": core.Stream.from_handle(cps.ptr),
        "ours": ours,
        "none": None,
    }
    for name, stream in kinds.items():
        bufs = cp.zeros(4, cp.uint32), cp.zeros(4, cp.uint64), cp.zeros(4, cp.uint64)
        args = [SmProbeParams(*(int(b.data.ptr) for b in bufs), 1000)]
        k.launch((4,), (32,), args, stream=stream)
        streams.synchronize_stream(stream)
        assert int(bufs[2].min()) > 0, name
    ours.close()


@pytest.mark.gpu
def test_cuda_core_setup_in_a_new_thread_keeps_the_current_green_context():
    import threading

    from cuda.bindings import driver as cu

    from megamoe_rt.graph.green import GreenPartitions

    seen = {}

    def body(ctx):
        try:
            driver.call(cu.cuCtxSetCurrent, ctx)
            s = streams.Stream()  # first cuda.core use in this thread
            seen["current"] = int(driver.call(cu.cuCtxGetCurrent))
            s.close()
        except BaseException as exc:
            seen["error"] = exc

    with GreenPartitions([("a", 16), ("b", "rest")]) as parts:
        ctx = parts["a"].ctx
        t = threading.Thread(target=body, args=(ctx,))
        t.start()
        t.join()
        assert "error" not in seen, seen.get("error")
        assert seen["current"] == int(ctx)


class _BareCai:
    """An array producer with only __cuda_array_interface__ (no device attribute)."""

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3}


@pytest.mark.gpu
def test_arrays_without_a_device_attribute_are_located_by_the_driver():
    import numpy as np

    from megamoe_rt.runtime.arrays import as_device_array, check_array

    cp = pytest.importorskip("cupy")
    dev = cp.zeros((4, 8), cp.float32)
    arr = as_device_array(_BareCai(int(dev.data.ptr), (4, 8), "<f4"), "x")
    assert arr.device is None
    check_array(arr, "x", dtypes=("float32",), device=0)
    with pytest.raises(ValueError, match="x: array is on device 0, expected device 1"):
        check_array(arr, "x", dtypes=("float32",), device=1)
    pinned = cp.cuda.alloc_pinned_memory(4 * 8 * 4)
    with pytest.raises(ValueError, match="x: data pointer 0x[0-9a-f]+ is host memory"):
        check_array(as_device_array(_BareCai(pinned.ptr, (4, 8), "<f4"), "x"), "x", dtypes=("float32",), device=0)
    host = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="x: data pointer 0x[0-9a-f]+ is not memory CUDA allocated"):
        check_array(as_device_array(_BareCai(host.ctypes.data, (4, 8), "<f4"), "x"), "x", dtypes=("float32",), device=0)


@pytest.mark.gpu
def test_quantize_fp8_checks_the_device_of_its_outputs():
    cp = pytest.importorskip("cupy")
    from megamoe_rt import quantize_fp8

    x = cp.ones((4, 256), cp.float32)
    pinned = cp.cuda.alloc_pinned_memory(4 * 256)
    with pytest.raises(ValueError, match="out: data pointer 0x[0-9a-f]+ is host memory"):
        quantize_fp8(x, out=_BareCai(pinned.ptr, (4, 256), "|u1"))
