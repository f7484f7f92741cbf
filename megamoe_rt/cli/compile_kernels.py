"""Building a list of kernel variants, in parallel, with a line per kernel as it finishes.

NVRTC compiles one program at a time in a process, so ``megamoe-rt compile`` spreads the
kernels over worker processes (``jobs``; 1 builds them in this process). Each finished kernel
gives one progress line on stderr; the results come back in the order of the list, the same
as a serial build's, so the command's table and JSON do not depend on who finished first.

Workers are fresh interpreters (``spawn``): they inherit none of the NVRTC and CUDA library
state this process has loaded. A kernel spec holds ctypes types that do not pickle, so a
worker is sent the kernel's name and finds the spec in its own registry; the compiled kernel
comes back without its spec and gets the caller's again. Workers ignore SIGINT: a Ctrl-C
reaches the whole process group, and only this process reports it (it ends the workers and
raises ``KeyboardInterrupt``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any, TextIO

from megamoe_rt.jit import CompiledKernel, KernelSpec, compile_kernel


class KernelBuildError(RuntimeError):
    """A kernel failed to build in a worker process. The message names the kernel and the
    error; the worker's traceback is its ``__cause__``."""


def default_jobs() -> int:
    """The cores this process may run on (``os.process_cpu_count``, Python 3.13+; the
    scheduler affinity before that)."""
    count = getattr(os, "process_cpu_count", None)
    if count is not None:
        return max(1, count() or 1)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def progress_line(done: int, total: int, kernel: CompiledKernel) -> str:
    """``[ 12/114] name  3.1 s  168 regs  0 spill bytes`` (or ``cached``)."""
    r = kernel.resources
    what = (
        "cached"
        if kernel.from_cache
        else f"{kernel.compile_seconds:.1f} s  {r.registers} regs  {r.spill_bytes} spill bytes"
    )
    return f"[{done:>{len(str(total))}}/{total}] {kernel.spec.name}  {what}"


def build_kernels(
    specs: Sequence[KernelSpec],
    *,
    jobs: int | None = None,
    lineinfo: bool | None = None,
    use_cache: bool = True,
    progress: TextIO | None = sys.stderr,
) -> list[CompiledKernel]:
    """Compile ``specs`` (registry kernels) with ``jobs`` processes (default
    :func:`default_jobs`), one line on ``progress`` as each finishes; the results in the
    order of ``specs``. A build error is raised (the remaining builds stopped); Ctrl-C
    ends the workers and raises ``KeyboardInterrupt``."""
    jobs = min(default_jobs() if jobs is None else jobs, len(specs))
    if jobs <= 1:
        return _build_here(specs, lineinfo, use_cache, progress)
    _check_registry(specs)
    return _build_in_pool(specs, jobs, lineinfo, use_cache, progress)


def _report(progress: TextIO | None, done: int, total: int, kernel: CompiledKernel) -> None:
    if progress is not None:
        print(progress_line(done, total, kernel), file=progress, flush=True)


def _build_here(
    specs: Sequence[KernelSpec], lineinfo: bool | None, use_cache: bool, progress: TextIO | None
) -> list[CompiledKernel]:
    out = []
    for done, spec in enumerate(specs, 1):
        out.append(compile_kernel(spec, lineinfo=lineinfo, use_cache=use_cache))
        _report(progress, done, len(specs), out[-1])
    return out


def _check_registry(specs: Sequence[KernelSpec]) -> None:
    from megamoe_rt.kernels.registry import all_kernel_specs

    known = {s.name: s for s in all_kernel_specs()}
    other = [s.name for s in specs if known.get(s.name) != s]
    if other:
        raise ValueError(f"kernel {other[0]!r} is not the registry's: worker processes build registry kernels only")


def _build_in_pool(
    specs: Sequence[KernelSpec], jobs: int, lineinfo: bool | None, use_cache: bool, progress: TextIO | None
) -> list[CompiledKernel]:
    results: list[CompiledKernel | None] = [None] * len(specs)
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(lineinfo, use_cache)
    )
    try:
        with _sigint_blocked():  # the workers start here and inherit SIGINT blocked until they ignore it
            pending: dict[Future, int] = {pool.submit(_build_one, s.name): i for i, s in enumerate(specs)}
        done = 0
        while pending:
            # A Ctrl-C lands between waits, never inside one: wait() takes every pending future's
            # lock in turn, and an interrupt between two of them left those taken held, so the
            # executor's manager thread (and the shutdown below, which joins it) hung on them.
            # The signal stays pending while blocked and is raised as the block ends.
            with _sigint_blocked():
                finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for fut in finished:
                i = pending.pop(fut)
                kernel = CompiledKernel(spec=specs[i], **fut.result())
                results[i] = kernel
                done += 1
                _report(progress, done, len(specs), kernel)
    except BaseException:  # a build error or Ctrl-C: end the other builds now, not after them
        with _sigint_blocked():  # a second Ctrl-C waits until the workers are gone
            for p in multiprocessing.active_children():
                if p not in before:
                    p.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return [r for r in results if r is not None]


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while the block runs: one that comes meanwhile is
    raised after it, and processes started in it inherit the blocked signal (a Python
    handler would not survive their exec, and an ignored signal would be lost here)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# --- worker processes ---------------------------------------------------------------------

_worker_specs: dict[str, KernelSpec] = {}
_worker_options: dict[str, Any] = {}


def _init_worker(lineinfo: bool | None, use_cache: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports a Ctrl-C and ends the workers
    from megamoe_rt.kernels.registry import all_kernel_specs

    _worker_specs.update((s.name, s) for s in all_kernel_specs())
    _worker_options.update(lineinfo=lineinfo, use_cache=use_cache)


def _build_one(name: str) -> dict[str, Any]:
    """The compiled kernel's fields but its spec (which does not pickle)."""
    try:
        kernel = compile_kernel(_worker_specs[name], **_worker_options)
    except Exception as exc:  # NvrtcError and others do not unpickle: send the message, the traceback with it
        raise KernelBuildError(f"kernel {name}: {type(exc).__name__}: {exc}") from exc
    return {f.name: getattr(kernel, f.name) for f in dataclasses.fields(kernel) if f.name != "spec"}
