"""Rank functions for the launcher tests (module level: spawn pickles them by name)."""

import os
import time


def double_rank(ctx, offset):
    return ctx.rank * 2 + offset


def share_id(ctx):
    uid = ctx.broadcast(b"uid-" + os.urandom(8) if ctx.rank == 0 else None, key="uid")
    ctx.barrier()
    ctx.barrier()
    return uid, os.environ.get("NVSHMEM_DISABLE_NVLS"), os.getpid()


def one_raises(ctx, pid_dir):
    with open(os.path.join(pid_dir, f"{ctx.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(0.5)
        raise ValueError("rank one is broken")
    time.sleep(120)


def one_dies(ctx):
    if ctx.rank == 2:
        os._exit(7)
    time.sleep(120)


def broadcast_twice(ctx):
    first = ctx.broadcast(b"one" if ctx.rank == 0 else None)
    second = ctx.broadcast(b"two" if ctx.rank == 0 else None)
    return first, second


def unpicklable(ctx):
    return lambda: None


def quiet_exit(ctx):
    if ctx.rank == 1:
        os._exit(0)
    return ctx.rank


def leaves_before_the_barrier(ctx):
    """Rank 0 returns at once; the others wait at a barrier rank 0 never joins."""
    if ctx.rank == 0:
        return "left"
    ctx.barrier()
    return "met"


def bootstrap_env(ctx):
    return os.environ.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"), os.environ.get("NVSHMEM_DISABLE_NVLS")


def late_root_broadcast(ctx):
    """The others ask before rank 0 has put its value."""
    if ctx.rank == 0:
        time.sleep(0.5)
    return ctx.broadcast(b"late" if ctx.rank == 0 else None, key="late")


def gather_rounds(ctx, rounds):
    import random

    rng = random.Random(ctx.rank)
    out = []
    for i in range(rounds):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.01)
        out.append(ctx.allgather(f"{ctx.rank}:{i}".encode() * (1 + i % 7), key="round"))
    return out


def leaves_before_the_allgather(ctx):
    if ctx.rank == 0:
        return None
    return ctx.allgather(b"x", key="status")


def agree_on_a_bad_rank(ctx):
    from megamoe_rt.ep import agreement

    local = TypeError("x: dtype float32 is not supported") if ctx.rank == 1 else None
    status = agreement.CallStatus.of_error(local) if local else agreement.CallStatus(bound=8)
    statuses = agreement.exchange(ctx, status)
    try:
        agreement.raise_if_refused(statuses, local)
    except TypeError as exc:
        # Every rank posts the text it raised; all must be equal.
        texts = ctx.allgather(str(exc).encode(), key="texts")
        assert len(set(texts)) == 1, texts
        raise
    return "launched"


def share_findings(ctx):
    from megamoe_rt.ep import agreement
    from megamoe_rt.runtime.errors import Finding

    mine = {
        0: (),
        1: (Finding("repeated_expert_id", 5, 3),),
        2: (Finding("expert_id_out_of_range", 1, 99),),
    }[ctx.rank]
    return agreement.exchange_findings(ctx, mine)


def half_built_symmetric_buffer(ctx):
    """Rank 1 cannot map rank 0's part, rank 0 cannot zero its own: both must free the
    allocation (a collective) and raise the same error."""
    from megamoe_rt.ep import symm
    from megamoe_rt.schedule.layout import symm_buffer_layout

    freed = []

    class Handle:
        def __init__(self, h):
            self.handle = h

    class FakeNvshmem:
        def buffer(self, nbytes):
            return Handle(0x10000)

        def free(self, buf):
            freed.append(buf.handle)

    class FakeRuntime:
        world_size, rank, device = ctx.world_size, ctx.rank, 0
        _nvshmem, _buffers = FakeNvshmem(), []

    FakeRuntime.ctx = ctx

    def no_cupy():
        raise RuntimeError("no device memory to zero here")

    symm.require_cupy = no_cupy
    symm.peer_address = lambda local, pe: 0 if (ctx.rank == 1 and pe == 0) else 0x20000 + pe
    layout = symm_buffer_layout(512, 256, 8, 2, 16, ctx.world_size)
    try:
        symm.SymmetricBuffer(layout, FakeRuntime())
    except RuntimeError as exc:
        return str(exc), freed, FakeRuntime._buffers
    return None, freed, FakeRuntime._buffers


def bootstrap_with_a_failed_first_attempt(ctx, failing, attempts_failing=1):
    """NvshmemRuntime's unique-id bootstrap against a stand-in NVSHMEM whose init fails on
    the ranks in ``failing`` for the first ``attempts_failing`` attempts (a stray connection)."""
    import numpy as np

    from megamoe_rt.ep.symm import NvshmemRuntime

    calls = {"init": 0, "finalize": 0}

    class Uid:
        def __init__(self):
            self._data = np.zeros(8, np.uint64)

    class FakeNvshmem:
        def get_unique_id(self, empty):
            uid = Uid()
            if not empty:
                uid._data[:] = calls["init"] + 100
            return uid

        def init(self, **kw):
            calls["init"] += 1
            if calls["init"] <= attempts_failing and ctx.rank in failing:
                raise RuntimeError("bootstrap: unexpected peer")

        def finalize(self):
            calls["finalize"] += 1

    rt = NvshmemRuntime.__new__(NvshmemRuntime)
    rt.ctx, rt.rank, rt.world_size = ctx, ctx.rank, ctx.world_size
    try:
        rt._init_from_unique_id(FakeNvshmem(), None, np)
    except RuntimeError as exc:
        return str(exc), calls
    return None, calls


def out_of_step(ctx):
    """Rank 1 makes an extra exchange the others do not: every rank must find out."""
    try:
        if ctx.rank == 1:
            ctx.allgather(b"extra", key="check")
        ctx.allgather(b"call", key="call-status")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def too_large(ctx):
    try:
        ctx.allgather(b"x" * (10_000 if ctx.rank == 0 else 10), key="big")
    except ValueError as exc:
        return str(exc)
    return "no error"


def findings_with_a_failed_rank(ctx):
    from megamoe_rt.ep import agreement

    failure = RuntimeError("CUDA_ERROR_LAUNCH_FAILED") if ctx.rank == 1 else None
    try:
        agreement.exchange_findings(ctx, (), failure)
    except RuntimeError as exc:
        return str(exc)
    return "no error"
