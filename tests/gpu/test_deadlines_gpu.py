"""Deadline-bounded waits on a GPU: a withheld signal or mbarrier arrival traps naming the wait
(printed once however many blocks time out), a present one passes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.traps import SYNC_AND_REPORT

_WAIT = textwrap.dedent("""
    import ctypes, sys
    import cupy as cp
    from megamoe_rt.runtime import driver
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import WAIT_SPEC
    from megamoe_rt.runtime.deadlines import TimeoutRecord
    from cuda.bindings import driver as cu
    word = cp.zeros(1, cp.uint64)
    word[0] = int(sys.argv[1])
    seen = cp.zeros(1, cp.uint64)
    k = get_kernel(WAIT_SPEC, driver.current_device())
    args = [ctypes.c_uint64(int(word.data.ptr)), ctypes.c_uint64(1), ctypes.c_uint64(200_000_000),
            ctypes.c_uint32(3), ctypes.c_uint32(5), ctypes.c_uint64(int(seen.data.ptr)),
            ctypes.c_uint64(TimeoutRecord.get().device_ptr)]
    k.launch((int(sys.argv[2]),), (32,), args)
    try:
        driver.call(cu.cuCtxSynchronize)
    except driver.CudaError as err:
        print("ERROR", err)
        sys.exit(3)
    print("seen", int(seen[0]))
""")


@pytest.mark.gpu
def test_a_withheld_signal_traps_with_a_message_instead_of_hanging():
    out = subprocess.run([sys.executable, "-c", _WAIT, "0", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    text = out.stdout + out.stderr
    # Once from the device printf, once from the record the host turns into the exception.
    assert text.count("wait 'test signal' timed out") == 2, text
    assert "rank 3, peer 5" in text and "expected >= 1, saw 0" in text


@pytest.mark.gpu
def test_a_present_signal_passes_the_wait():
    out = subprocess.run([sys.executable, "-c", _WAIT, "7", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "seen 7" in out.stdout


@pytest.mark.gpu
def test_a_wait_timing_out_in_every_block_prints_its_line_once():
    out = subprocess.run([sys.executable, "-c", _WAIT, "0", "48"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3
    text = out.stdout + out.stderr
    # One printf for the whole launch (the thread that claimed the record), one exception.
    assert text.count("wait 'test signal' timed out") == 2, text


_MBARRIER = (
    textwrap.dedent("""
    import ctypes, sys
    from megamoe_rt.runtime import driver
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import MBARRIER_WAIT_SPEC
    from megamoe_rt.runtime.deadlines import TimeoutRecord
    from cuda.bindings import driver as cu
    driver.ensure_context()
    k = get_kernel(MBARRIER_WAIT_SPEC, driver.current_device())
    ctx = TimeoutRecord.get().context(0.2, rank=3)
    args = [ctx, ctypes.c_uint32(int(sys.argv[1])), ctypes.c_uint32(5)]
    k.launch((4,), (64,), args)
""")
    + SYNC_AND_REPORT
)


@pytest.mark.gpu
def test_a_withheld_mbarrier_arrival_traps_naming_the_wait():
    out = subprocess.run([sys.executable, "-c", _MBARRIER, "0"], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert text.count("wait 'shared-memory stage loaded' timed out") == 1, text
    assert "rank 3: phase 0 of slot 5 never completed" in text, text


@pytest.mark.gpu
def test_a_completed_mbarrier_phase_passes_the_wait():
    out = subprocess.run([sys.executable, "-c", _MBARRIER, "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "finished" in out.stdout, out.stdout + out.stderr
