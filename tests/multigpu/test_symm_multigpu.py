"""NVSHMEM symmetric buffers across ranks: peer regions by load/store, and signal words
whose waits have deadlines naming the peer (needs two Hopper GPUs and nvshmem4py)."""

from __future__ import annotations

import pytest

from megamoe_rt.ep.launch import RankFailed, spawn

pytestmark = pytest.mark.multigpu


def _layout(world):
    from megamoe_rt.schedule.layout import symm_buffer_layout

    return symm_buffer_layout(512, 256, 8 * world, 2, 128, world)


def _exchange_rows(ctx):
    import cupy as cp

    from megamoe_rt.ep.symm import NvshmemRuntime, SymmetricBuffer

    cp.cuda.Device(ctx.device).use()
    rt = NvshmemRuntime.initialize(ctx)
    buf = SymmetricBuffer(_layout(ctx.world_size), rt)
    assert int(buf.view("x").max()) == 0  # symmetric allocations start zeroed
    # Every rank stores its id (+1) into row `rank` of every rank's x, through peer addresses.
    for peer in range(ctx.world_size):
        buf.peer_view(peer, "x")[ctx.rank, :] = ctx.rank + 1
    cp.cuda.Device().synchronize()
    ctx.barrier()
    rows = cp.asnumpy(buf.view("x")[: ctx.world_size + 1, :4]).tolist()
    distinct = len(set(buf.peer_base_ptrs))
    ctx.barrier()
    buf.close()
    rt.finalize()
    return rows, distinct


def test_every_rank_sees_its_peers_stores():
    results = spawn(_exchange_rows, 2, timeout=180)
    for rows, distinct in results:
        assert rows == [[1] * 4, [2] * 4, [0] * 4]
        assert distinct == 2


def _signal(ctx, withhold):
    import ctypes

    import cupy as cp
    from cuda.bindings import driver as cu

    from megamoe_rt.ep.symm import NvshmemRuntime, SymmetricBuffer
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import WAIT_SPEC
    from megamoe_rt.runtime import driver
    from megamoe_rt.runtime.deadlines import TimeoutRecord

    cp.cuda.Device(ctx.device).use()
    rt = NvshmemRuntime.initialize(ctx)
    buf = SymmetricBuffer(_layout(ctx.world_size), rt)
    if ctx.rank == 0:
        seen = cp.zeros(1, cp.uint64)
        kernel = get_kernel(WAIT_SPEC, ctx.device)
        # Any zeroed u64 word of the symmetric buffer serves as the signal: the first send-list entry.
        args = [
            ctypes.c_uint64(buf.ptr("send_list")),
            ctypes.c_uint64(7),
            ctypes.c_uint64(500_000_000),
            ctypes.c_uint32(0),
            ctypes.c_uint32(1),
            ctypes.c_uint64(int(seen.data.ptr)),
            ctypes.c_uint64(TimeoutRecord.get().device_ptr),
        ]
        kernel.launch((1,), (32,), args)  # waits for rank 1's store while the host moves on
        ctx.barrier()
        driver.call(cu.cuCtxSynchronize)  # raises CudaError naming the wait when it traps
        result = int(seen[0])
    else:
        ctx.barrier()
        if not withhold:
            buf.peer_view(0, "send_list")[0] = 7
            cp.cuda.Device().synchronize()
        result = None
    ctx.barrier()
    buf.close()
    rt.finalize()
    return result


def test_a_peer_signal_releases_the_wait():
    assert spawn(_signal, 2, args=(False,), timeout=180)[0] == 7


def test_a_withheld_peer_signal_traps_naming_the_peer():
    with pytest.raises(RankFailed) as info:
        spawn(_signal, 2, args=(True,), timeout=180)
    text = str(info.value)
    assert "wait 'test signal' timed out" in text and "peer 1" in text, text


def _barrier_on_any_stream(ctx):
    import cupy as cp

    from megamoe_rt.ep.symm import NvshmemRuntime
    from megamoe_rt.runtime import streams

    cp.cuda.Device(ctx.device).use()
    rt = NvshmemRuntime.initialize(ctx)
    if rt.shares_gpu:  # NVSHMEM has no on-stream barrier there: refused on every rank, no abort
        with pytest.raises(RuntimeError, match="ranks share a GPU"):
            rt.barrier()
        rt.finalize()
        return True
    cps = cp.cuda.Stream(non_blocking=True)
    ours = streams.Stream()
    # None (CuPy's current stream), a CuPy stream, a raw handle, ours and its cuda.core stream.
    for stream in (None, cps, cps.ptr, ours, ours.core):
        rt.barrier(stream)
    cps.synchronize()
    ours.synchronize()
    ours.close()
    rt.finalize()
    return True


def test_the_nvshmem_barrier_takes_any_stream():
    assert spawn(_barrier_on_any_stream, 2, timeout=180) == [True, True]
