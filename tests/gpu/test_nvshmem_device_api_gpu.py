"""A kernel that calls NVSHMEM's device API, end to end on one GPU: NVRTC's relocatable code
linked with NVSHMEM's device library by nvJitLink, loaded, handed NVSHMEM's device state
(nvshmemx_culibrary_init) and launched on a one-PE world, where its put, fence, signal and
nvshmem_ptr act on this PE's own symmetric memory. Loading it before NVSHMEM runs, or after
it has ended, is refused.

The check runs in a child process: NVSHMEM's initialisation and finalisation stay out of the
test session's process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("cupy")
pytest.importorskip("nvshmem.core")

SCRIPT = textwrap.dedent(
    """
    import ctypes

    import cupy as cp

    from megamoe_rt.ep.symm import NvshmemRuntime
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import NVSHMEM_LINK_SPEC


    class OneRank:  # the whole world is this process
        rank, world_size, device = 0, 1, 0

        def broadcast(self, value, *, key="default", root=0):
            return value

        def barrier(self):
            pass

        def allgather(self, value, *, key="default"):
            return [value]


    try:
        get_kernel(NVSHMEM_LINK_SPEC, 0)
        print("before init: loaded")
    except RuntimeError as exc:
        print("before init:", exc)
    rt = NvshmemRuntime.initialize(OneRank())
    buf = rt._nvshmem.buffer(64)
    base = int(buf.handle)
    words = cp.ndarray((16,), cp.int32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(base, 64, buf), 0))
    words[:] = 12345  # poison: dst (word 0) and the 64-bit signal (words 2-3)
    words[2:4] = 0
    out = cp.full(3, -7, cp.int32)
    cp.cuda.Device().synchronize()
    kernel = get_kernel(NVSHMEM_LINK_SPEC, 0)
    args = [ctypes.c_uint64(base), ctypes.c_uint64(base + 8), ctypes.c_uint64(out.data.ptr), ctypes.c_int32(0)]
    kernel.launch((1,), (32,), args)
    kernel.launch((1,), (32,), args)  # the signal adds up
    cp.cuda.Device().synchronize()
    print("out:", out.tolist())
    print("dst:", int(words[0]), "signal:", int(words[2:4].view(cp.uint64)[0]))
    rt._nvshmem.free(buf)
    rt.finalize()  # takes the library's NVSHMEM state back and forgets the loaded kernel
    try:
        get_kernel(NVSHMEM_LINK_SPEC, 0)
        print("after finalize: loaded")
    except RuntimeError as exc:
        print("after finalize:", exc)
    """
)


def test_a_device_api_kernel_is_linked_initialised_and_runs_on_one_pe():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(
        line.startswith("before init: kernel nvshmem_link_probe calls NVSHMEM's device API: initialise NVSHMEM")
        for line in lines
    ), out.stdout
    # nvshmem_ptr of this PE's own memory is direct, my_pe 0, n_pes 1
    assert "out: [1, 0, 1]" in lines, out.stdout
    # the put wrote my_pe (0) over the poison; two launches added 1 to the signal twice
    assert "dst: 0 signal: 2" in lines, out.stdout
    # once NVSHMEM has ended, the kernel is not handed out from the cache: loading is refused again
    assert any(
        line.startswith("after finalize: kernel nvshmem_link_probe calls NVSHMEM's device API") for line in lines
    )
