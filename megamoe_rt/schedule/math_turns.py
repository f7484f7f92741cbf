"""The two math warpgroups' turn order in the GEMM mainloop (CPU model of gemm::MathTurns,
cuda_src/gemm/mainloop.cuh).

Two hardware named barriers of 256 threads, ``T0`` and ``T1``. Warpgroup ``w`` (128 threads)
runs, for every step of every tile: ``bar.sync T_w`` (its turn), issue its wgmmas, ``bar.arrive
T_(1-w)`` (the other's turn). Warpgroup 1 arrives on ``T0`` once before its first step and
warpgroup 0 syncs on ``T0`` once after its last. A named barrier completes when the threads
that reached it (arrived or syncing) number 256: then the syncing threads go on and the count
starts again.

:func:`run` plays both warpgroups' programs under an arbitrary interleaving and reports the
order in which the steps were issued; :class:`BarrierMisuse` is raised where a barrier would
complete without the warpgroup whose turn it is (an arrival counted twice), and
:class:`Deadlock` where neither warpgroup can move.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

THREADS = 256  # each barrier: both warpgroups
WARPGROUP = 128


class Deadlock(RuntimeError):
    pass


class BarrierMisuse(RuntimeError):
    pass


@dataclass
class _Barrier:
    count: int = 0
    syncing: list[int] = field(default_factory=list)  # warpgroups blocked in bar.sync
    arrived: list[int] = field(default_factory=list)


def program(wg: int, steps: int, *, begin: bool = True, end: bool = True) -> list[tuple[str, int]]:
    """Warpgroup ``wg``'s operations: ("sync" | "arrive", barrier) and ("issue", step)."""
    ops: list[tuple[str, int]] = []
    if begin and wg == 1:
        ops.append(("arrive", 0))
    for step in range(steps):
        ops += [("sync", wg), ("issue", step), ("arrive", 1 - wg)]
    if end and wg == 0:
        ops.append(("sync", 0))
    return ops


def run(
    steps: int,
    rng: random.Random,
    *,
    begin: bool = True,
    end: bool = True,
    programs: list[list[tuple[str, int]]] | None = None,
) -> tuple[list[int], list[int]]:
    """Both programs (``programs``, default :func:`program`'s) under a random interleaving: the
    warpgroups in the order their steps were issued, and each barrier's count left at the end."""
    progs = programs if programs is not None else [program(w, steps, begin=begin, end=end) for w in (0, 1)]
    pc = [0, 0]
    blocked = [False, False]
    bars = [_Barrier(), _Barrier()]
    issued: list[int] = []
    while pc[0] < len(progs[0]) or pc[1] < len(progs[1]):
        ready = [w for w in (0, 1) if pc[w] < len(progs[w]) and not blocked[w]]
        if not ready:
            raise Deadlock(f"both warpgroups wait: pc {pc}, counts {[b.count for b in bars]}")
        w = rng.choice(ready)
        op, arg = progs[w][pc[w]]
        pc[w] += 1
        if op == "issue":
            issued.append(w)
            continue
        bar = bars[arg]
        bar.count += WARPGROUP
        (bar.syncing if op == "sync" else bar.arrived).append(w)
        if op == "sync":
            blocked[w] = True
        if bar.count == THREADS:
            # Barrier T_w completes for warpgroup w's turn: it must be w syncing and the other arriving.
            if bar.syncing != [arg] or bar.arrived != [1 - arg]:
                raise BarrierMisuse(f"T{arg} completed with syncing {bar.syncing} and arrived {bar.arrived}")
            for s in bar.syncing:
                blocked[s] = False
            bars[arg] = _Barrier()
    return issued, [b.count for b in bars]
