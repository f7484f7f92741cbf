"""Rank functions for the cross-rank agreement tests (module level: spawn pickles them by name).

Each runs in a rank process started by ``spawn``; the GPU, NVSHMEM and CuPy are stood in for
where a test reaches them, so the agreement runs over the real launcher group on the CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

SHAPE = (512, 256, 8, 2, 64)  # hidden, intermediate, experts, top-k, tokens per rank


def _no_gpu_here():
    """Every rank's GPU check fails, the same way on every rank (the CPU has none)."""
    from megamoe_rt.runtime import devices

    def require_hopper(device=None):
        raise RuntimeError("no Hopper GPU on this CPU-only test rank")

    devices.require_hopper = require_hopper


def _outcome(build):
    try:
        build()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None, None


def construct_with_each_setting_differing(ctx, cases):
    """For each ``(name, rank 0's value, rank 1's value)``: every rank constructs the layer with
    its own value of that one setting; returns what each construction raised. The GPU check
    fails on every rank, so a construction that passes the agreement ends there."""
    from megamoe_rt.ep import symm
    from megamoe_rt.layer import MegaMoE

    _no_gpu_here()

    def no_nvshmem(*a, **k):
        raise AssertionError("NVSHMEM must not start")

    symm.NvshmemRuntime.initialize = classmethod(no_nvshmem)  # type: ignore[method-assign]
    out = []
    for name, mine, theirs in cases:
        value = mine if ctx.rank == 0 else theirs
        kwargs = {} if value == "<default>" else {name: value}
        positional = list(SHAPE)
        for i, field in enumerate(("hidden", "intermediate", "num_experts", "num_topk", "num_max_tokens_per_rank")):
            if field in kwargs:
                positional[i] = kwargs.pop(field)
        out.append(_outcome(lambda p=positional, kw=kwargs: MegaMoE(*p, group=ctx, **kw)))
    return out


def one_rank_passes_a_bad_argument(ctx, name, value):
    """Only rank 1 passes ``name=value`` (refused by its checks); every rank must raise."""
    from megamoe_rt.layer import MegaMoE

    _no_gpu_here()
    kwargs = {name: value} if ctx.rank == 1 else {}
    return _outcome(lambda: MegaMoE(*SHAPE, group=ctx, **kwargs))


def one_rank_has_no_gpu(ctx):
    """Rank 1's GPU check fails, rank 0's passes: no rank may start NVSHMEM."""
    from megamoe_rt.ep import symm
    from megamoe_rt.layer import MegaMoE
    from megamoe_rt.runtime import devices, driver

    started = []

    def require_hopper(device=None):
        if ctx.rank == 1:
            raise RuntimeError("device 1 (NVIDIA A100) has compute capability 8.0")
        return SimpleNamespace(ordinal=ctx.rank, sm_count=132)

    devices.require_hopper = require_hopper
    driver.ensure_context = lambda device: None
    symm.NvshmemRuntime.initialize = classmethod(lambda cls, *a, **k: started.append(1))  # type: ignore[method-assign]
    return _outcome(lambda: MegaMoE(*SHAPE, group=ctx)), started


def one_rank_fails_its_layout(ctx):
    """Both ranks have a GPU; rank 1's layout computation fails: no rank allocates."""
    from megamoe_rt import layer as layer_module
    from megamoe_rt import layer_setup
    from megamoe_rt.ep import symm
    from megamoe_rt.runtime import devices, driver

    started = []
    devices.require_hopper = lambda device=None: SimpleNamespace(ordinal=ctx.rank, sm_count=132)
    driver.ensure_context = lambda device: None
    symm.NvshmemRuntime.initialize = classmethod(lambda cls, *a, **k: started.append(1))  # type: ignore[method-assign]
    real = layer_setup.layer_layout

    def layer_layout(mode_cls, spec, **kw):
        if ctx.rank == 1:
            raise MemoryError("free device memory: 12 MiB")
        return real(mode_cls, spec, **kw)

    layer_setup.layer_layout = layer_layout
    return _outcome(lambda: layer_module.MegaMoE(*SHAPE, group=ctx, mode="unfused", transport="nvlink")), started


# --- the symmetric buffer and NVSHMEM's host collectives, NVSHMEM stood in for ----------------


class _Handle:
    def __init__(self, h):
        self.handle = h


def _fake_runtime(ctx, *, refuse_on=(), log=None):
    """A stand-in NvshmemRuntime of this rank whose nvshmem_malloc fails on the ranks in
    ``refuse_on`` (the heap is exhausted there); ``log`` records the NVSHMEM calls made."""
    log = [] if log is None else log

    class FakeNvshmem:
        def buffer(self, nbytes):
            log.append(("malloc", nbytes))
            if ctx.rank in refuse_on:
                raise MemoryError(f"nvshmem_malloc of {nbytes} bytes: the symmetric heap is exhausted")
            return _Handle(0x10000)

        def free(self, buf):
            log.append(("free", buf.handle))

    return SimpleNamespace(
        ctx=ctx, rank=ctx.rank, world_size=ctx.world_size, device=0, _nvshmem=FakeNvshmem(), _buffers=[]
    ), log


def _zero_nothing(symm):
    """The buffer's zeroing and peer mapping stood in for (no device memory here)."""

    class FakeArray:
        def fill(self, value):
            pass

    class FakeDevice:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    cupy = SimpleNamespace(cuda=SimpleNamespace(Device=FakeDevice))
    symm.require_cupy = lambda: cupy
    symm.SymmetricBuffer._bytes = lambda self, offset, nbytes, base=None: FakeArray()
    symm.peer_address = lambda local, pe: 0x20000 + pe


def allocate_with_a_heap_exhausted_on(ctx, refuse_on, then_again=False):
    """A symmetric buffer whose nvshmem_malloc fails on ``refuse_on``; optionally a second
    allocation after it. Returns (errors, NVSHMEM calls, whether the heaps are out of step)."""
    from megamoe_rt.ep import symm
    from megamoe_rt.schedule.layout import symm_buffer_layout

    _zero_nothing(symm)
    rt, log = _fake_runtime(ctx, refuse_on=set(refuse_on))
    layout = symm_buffer_layout(*SHAPE, ctx.world_size)
    errors = [_outcome(lambda: symm.SymmetricBuffer(layout, rt))]
    if then_again:
        errors.append(_outcome(lambda: symm.SymmetricBuffer(layout, rt)))
    return errors, log, getattr(rt, "heap_out_of_step", None)


def allocate_with_layouts(ctx, tokens_by_rank, ranks_by_rank=None):
    """Each rank lays out its buffer for its own token capacity (and rank count)."""
    from megamoe_rt.ep import symm
    from megamoe_rt.schedule.layout import symm_buffer_layout

    _zero_nothing(symm)
    rt, log = _fake_runtime(ctx)
    world = ctx.world_size if ranks_by_rank is None else ranks_by_rank[ctx.rank]
    layout = symm_buffer_layout(*SHAPE[:4], tokens_by_rank[ctx.rank], world)
    return _outcome(lambda: symm.SymmetricBuffer(layout, rt)), log


def close_with_a_failed_wait_on(ctx, failing_rank):
    """Both ranks hold a buffer; ``failing_rank``'s wait for its device fails at close: no rank
    may free (the free is collective), every rank raises."""
    from megamoe_rt.ep import symm
    from megamoe_rt.schedule.layout import symm_buffer_layout

    _zero_nothing(symm)
    rt, log = _fake_runtime(ctx)
    buf = symm.SymmetricBuffer(symm_buffer_layout(*SHAPE, ctx.world_size), rt)

    class BrokenDevice:
        def __init__(self, device):
            pass

        def synchronize(self):
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    if ctx.rank == failing_rank:
        symm.require_cupy = lambda: SimpleNamespace(cuda=SimpleNamespace(Device=BrokenDevice))
    return _outcome(buf.close), log, rt._buffers


def free_after_the_peer_left(ctx):
    """Rank 1 returns without freeing; rank 0's meeting before nvshmem_free must fail at once
    (rank 1 has ended), naming the collective, instead of waiting inside NVSHMEM."""
    from megamoe_rt.ep import symm

    if ctx.rank == 1:
        return "left"
    rt, log = _fake_runtime(ctx)
    symm.symmetric_free(rt, _Handle(0x10000), "a symmetric buffer")
    return log


# --- NVSHMEM start-up ------------------------------------------------------------------------


def start_nvshmem(ctx, heap_sizes=None, set_current_fails_on=None, uid_fails=False):
    """NvshmemRuntime's start-up against a stand-in NVSHMEM and cuda.core Device: returns what
    it raised and the NVSHMEM calls made."""
    import cuda.core
    import numpy as np

    from megamoe_rt.ep import symm

    log: list = []

    class Uid:
        def __init__(self):
            self._data = np.zeros(8, np.uint64)

    class FakeNvshmem:
        class Teams:
            TEAM_WORLD = "world"

        def get_unique_id(self, empty):
            if uid_fails and not empty:
                raise RuntimeError("bootstrap: no interface to listen on")
            uid = Uid()
            if not empty:
                uid._data[:] = 7
            return uid

        def init(self, **kw):
            log.append("init")

        def buffer(self, nbytes):
            log.append("malloc")
            return _Handle(0x10000)

        def free(self, buf):
            log.append("free")

        def finalize(self):
            log.append("finalize")

    class Device:
        def __init__(self, ordinal):
            self.uuid = f"GPU-{ordinal}"

        def set_current(self):
            if ctx.rank == set_current_fails_on:
                raise RuntimeError("CUDA_ERROR_NO_DEVICE")

    cuda.core.Device = Device
    symm._nvshmem = FakeNvshmem
    symm.peer_address = lambda local, pe: 0x20000 + pe
    os.environ.pop("NVSHMEM_SYMMETRIC_SIZE", None)
    if heap_sizes is not None:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = heap_sizes[ctx.rank]
    try:
        rt = symm.NvshmemRuntime(ctx, heap_bytes=1 << 20)
    except Exception as exc:
        return (type(exc).__name__, str(exc)), log
    mapped = rt.every_peer_mapped()
    rt.finalize()
    return (None, mapped), log
