"""Rank functions for the liveness tests (module level: spawn pickles them by name)."""

import json
import os
import signal
import time


def victim_after_barrier(ctx, victim, sig, out_dir, op="barrier"):
    """Every rank meets once; then ``victim`` sends itself ``sig`` and the others wait in
    ``op`` ("barrier" or "allgather") for it. Each survivor writes what it saw to
    ``out_dir/<rank>.json`` before raising it again."""
    if ctx.rank == victim:
        ctx.barrier()
        time.sleep(0.2)  # rank 0 serves the hub: its answers to the others' barrier go out first
        with open(os.path.join(out_dir, "victim.json"), "w") as f:
            json.dump({"t": time.time(), "pid": os.getpid()}, f)
        os.kill(os.getpid(), sig)
        time.sleep(60)  # a stopped rank never gets here before it is killed
        return None
    t0 = time.time()
    try:
        ctx.barrier()
        if op == "barrier":
            ctx.barrier()
        else:
            ctx.allgather(b"x", key="after")
    except Exception as exc:
        seen = {"type": type(exc).__name__, "rank": getattr(exc, "rank", None), "text": str(exc), "t": time.time()}
        with open(os.path.join(out_dir, f"{ctx.rank}.json"), "w") as f:
            json.dump(seen, f)
        raise
    return time.time() - t0


def busy_then_meet(ctx, sleep_s):
    """Rank 1 makes no hub call for ``sleep_s`` (its heartbeat keeps it alive); then all meet."""
    if ctx.rank == 1:
        time.sleep(sleep_s)
    ctx.barrier()
    return ctx.rank


def kill_self(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def death_signal(ctx):
    """The signal this rank gets when its launcher dies (Linux ``PR_GET_PDEATHSIG``)."""
    import ctypes

    value = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)
    return value.value
