"""The fault suite: inject each fault the runtime must survive, record what happens.

``python -m megamoe_rt.cli.faults [--only A,B] [--limit S] [--json] [-o F] [--md F]``. Every fault
runs in a fresh process (a trap ends the CUDA context of the process it happens in) under a
wall-clock limit of its own (``_LIMITS``; ``--limit`` sets one for all), so a hang shows as a hang.
Per fault: the outcome (the error raised, or what the runtime did instead), the time from the
faulty step to the error, whether later calls in the same process work, and, for faults across
ranks, what each process saw (``seen``).

The faults across ranks run two ranks on GPU 0 (``MEGAMOE_RT_RANK_DEVICES=0``: they time-share
it, so their times say when an error came, not how fast a call is), under ``megamoe-rt launch``
or as two processes started the way torchrun starts them (megamoe_rt/cli/faults_ep.py);
``bad_input_one_rank`` and ``rank_killed_mid_call`` use one GPU per rank where there are two.
With a warm kernel cache the whole suite takes a few minutes; each limit is a few times its
fault's usual time.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from megamoe_rt.cli.output import (
    add_output_options,
    check_output,
    check_writable,
    emit,
    progress_to_stderr,
)
from megamoe_rt.cli.usage import Parser, UsageError, positive_seconds, report

# What each scenario's script shares: a small layer and its inputs.
_PRELUDE = """
import json, sys, time
import numpy as np
import cupy as cp
from megamoe_rt import MegaMoE, DeviceInputError, reference as ref, testing
H, I, E, K, T = 512, 256, 8, 2, 64
rng = np.random.default_rng(1)
inp = ref.random_moe_inputs(rng, T, H, I, E, K)
def layer_of(**kw):
    layer = MegaMoE(H, I, E, K, T, **kw)
    layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    return layer
def args_of(idx=None):
    return (cp.asarray(inp["x"].view(np.uint8)), cp.asarray(inp["x_sf"]),
            cp.asarray(inp["topk_idx"] if idx is None else idx), cp.asarray(inp["topk_weights"]))
def good_call_ok(layer):
    y = layer(*args_of())
    layer.synchronize()
    got = (cp.asnumpy(y).astype(np.uint32) << 16).view(np.float32)
    exp = ref.moe_forward(inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"],
                          inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    return bool(ref.calc_diff(got, exp.astype(np.float32)) < 1e-3)
def report(outcome, detect_s, later, seen=None):
    print("FAULT-RESULT " + json.dumps({"outcome": outcome, "detect_s": detect_s, "later": later, "seen": seen}))
from megamoe_rt.cli.faults import first_line
"""

# name -> (what is injected, script body); the body calls report(...) once.
_SCENARIOS: dict[str, tuple[str, str]] = {
    "bad_ids": (
        "an expert id outside [-1, E) in one call",
        """
        layer = layer_of()
        idx = inp["topk_idx"].copy(); idx[3, 1] = E + 5
        layer(*args_of(idx))
        t0 = time.monotonic()
        try:
            layer.synchronize(); report("no error", None, None)
        except DeviceInputError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "repeated_ids": (
        "one expert twice in a token's top-k",
        """
        layer = layer_of()
        idx = inp["topk_idx"].copy(); idx[5, 1] = idx[5, 0]
        layer(*args_of(idx))
        cp.cuda.Device().synchronize()
        t0 = time.monotonic()
        try:
            layer(*args_of()); report("no error", None, None)
        except DeviceInputError as exc:  # raised by the next call, which launches nothing
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "bad_group_offsets": (
        "grouped GEMM group_offsets not multiples of the tile height",
        """
        from megamoe_rt import grouped_gemm_fp8, quantize_fp8, quantize_weight_fp8
        a, a_sf = quantize_fp8(cp.random.standard_normal((384, 256), dtype=cp.float32))
        b, b_sf = quantize_weight_fp8(cp.random.standard_normal((2, 256, 256), dtype=cp.float32))
        t0 = time.monotonic()
        try:
            grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=cp.asarray(np.array([0, 100, 256], np.int32)))
            report("no error", None, None)
        except ValueError as exc:
            detect = time.monotonic() - t0
            grouped_gemm_fp8(a, a_sf, b, b_sf, group_offsets=cp.asarray(np.array([0, 128, 256], np.int32)))
            cp.cuda.Device().synchronize()
            report(first_line(exc), detect, "yes")
        """,
    ),
    "withheld_signal": (
        "fused: one block never publishes its rows (timeout_s=0.5)",
        """
        from megamoe_rt.runtime import driver
        from cuda.bindings import driver as cu
        layer = layer_of(mode="fused", timeout_s=0.5)
        t0 = time.monotonic()
        with testing.withhold_block(layer, 0):
            layer(*args_of())
        try:
            driver.call(cu.cuCtxSynchronize); report("no error", None, None)
        except driver.CudaError as exc:
            report(first_line(exc), time.monotonic() - t0, "no: the trap ends the CUDA context; restart the process")
        """,
    ),
    "single_wave_past_ring": (
        "fused: a single-wave order larger than the ring (what a bound below a peer's count does)",
        """
        from megamoe_rt.runtime import driver
        from megamoe_rt.modes.fused import CallSchedule
        from cuda.bindings import driver as cu
        H, I, E, K, T = 512, 256, 16, 6, 2048
        inp = ref.random_moe_inputs(rng, T, H, I, E, K)
        layer = layer_of(mode="fused", timeout_s=1.0)
        full = testing.fused_schedule_of(layer).full_pool_blocks
        t0 = time.monotonic()
        with testing.force_call_schedule(layer, CallSchedule(True, full, 4)):
            layer(*args_of())
        try:
            driver.call(cu.cuCtxSynchronize); report("no error", None, None)
        except driver.CudaError as exc:
            report(first_line(exc), time.monotonic() - t0, "no: the trap ends the CUDA context; restart the process")
        """,
    ),
    "ring_too_small": (
        "fused: ring_blocks below the schedule's live window",
        """
        t0 = time.monotonic()
        try:
            layer_of(mode="fused", ring_blocks=2); report("no error", None, None)
        except ValueError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer_of(mode="fused")) else "no")
        """,
    ),
    "bound_below_tokens": (
        "num_tokens_bound below the call's token count",
        """
        layer = layer_of()
        t0 = time.monotonic()
        try:
            layer(*args_of(), num_tokens_bound=T // 2); report("no error", None, None)
        except ValueError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "timeout_zero": (
        "timeout_s=0",
        """
        t0 = time.monotonic()
        try:
            layer_of(timeout_s=0); report("no error", None, None)
        except ValueError as exc:
            report(first_line(exc), time.monotonic() - t0, "yes" if good_call_ok(layer_of()) else "no")
        """,
    ),
    "timeout_huge": (
        "timeout_s=1e30 (clamped to 2^58 ns)",
        """
        layer = layer_of(timeout_s=1e30)
        report("accepted, clamped; calls run", None, "yes" if good_call_ok(layer) else "no")
        """,
    ),
    "weights_reloaded_under_graph": (
        "load_weights again after a call was captured in a CUDA graph",
        """
        layer = layer_of()
        a = args_of(); y = cp.empty((T, H), cp.uint16)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            layer(*a, out=y, stream=s); s.synchronize()
            s.begin_capture(); layer(*a, out=y, stream=s); g = s.end_capture()
            w = ref.random_moe_inputs(np.random.default_rng(9), 1, H, I, E, K)
            layer.load_weights(w["w1"], w["w1_sf"], w["w2"], w["w2_sf"], stream=s)
            g.launch(stream=s); s.synchronize()
        got = (cp.asnumpy(y).astype(np.uint32) << 16).view(np.float32)
        exp = ref.moe_forward(inp["x"], inp["x_sf"], inp["topk_idx"], inp["topk_weights"],
                              w["w1"], w["w1_sf"], w["w2"], w["w2_sf"])
        ok = ref.calc_diff(got, exp.astype(np.float32)) < 1e-3
        report("the replay computes with the new weights" if ok else "WRONG: the replay used stale weights", None,
               "yes" if ok else "no")
        """,
    ),
    "planted_cache_entry": (
        "a cubin cache entry overwritten with garbage",
        """
        import os
        from megamoe_rt.jit import compile_kernel
        from megamoe_rt.jit.cache import CubinCache
        from megamoe_rt.kernels import moe as mk
        spec = mk.combine_spec("int32")
        first = compile_kernel(spec)
        cache = CubinCache()
        path = cache.path_for(first.cache_key)
        with open(path, "r+b") as f:
            f.seek(64); f.write(os.urandom(256))
        t0 = time.monotonic()
        again = compile_kernel(spec)
        outcome = "entry refused and rebuilt" if not again.from_cache else "WRONG: the damaged entry was loaded"
        report(outcome, time.monotonic() - t0, "yes" if good_call_ok(layer_of(mode="unfused")) else "no")
        """,
    ),
    "bad_input_one_rank": (
        "EP2 under spawn (one GPU: both ranks on GPU 0): one rank passes x_sf of the wrong shape",
        """
        from megamoe_rt.ep.launch import spawn, RankFailed
        from megamoe_rt.cli import faults
        if cp.cuda.runtime.getDeviceCount() < 2:
            faults.share_gpu_0()
        t0 = time.monotonic()
        out = spawn(faults.bad_input_rank, 2, timeout=300)
        same = len({m for m, _ in out}) == 1
        report(("every rank: " if same else "RANKS DIFFER: ") + out[0][0], time.monotonic() - t0,
               "yes" if all(ok for _, ok in out) else "no")
        """,
    ),
    "rank_killed_mid_call": (
        "EP2 under spawn (one GPU: both ranks on GPU 0): a rank's process exits right after launching a call (timeout_s=2)",
        """
        from megamoe_rt.ep.launch import spawn, RankFailed
        from megamoe_rt.cli import faults
        if cp.cuda.runtime.getDeviceCount() < 2:
            faults.share_gpu_0()
        t0 = time.monotonic()
        try:
            spawn(faults.killed_rank, 2, timeout=300); report("no error", None, None)
        except RankFailed as exc:
            report(first_line(exc), time.monotonic() - t0, "no: the launch is over; restart it")
        """,
    ),
    # --- across ranks: two ranks on GPU 0 (megamoe_rt/cli/faults_ep.py has the drivers and the rank bodies)
    "rank_sigkill_mid_call": (
        "EP2 under `megamoe-rt launch`, both ranks on GPU 0: rank 1 sends itself SIGKILL right after launching "
        "a call, rank 0 in that call (timeout_s=2)",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.signal_mid_call_launched("SIGKILL", timeout_s=INNER_S))
        """,
    ),
    "rank_sigstop_mid_call": (
        "EP2 under `megamoe-rt launch`, both ranks on GPU 0: rank 1 sends itself SIGSTOP right after launching "
        "a call, rank 0 in that call (timeout_s=2)",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.signal_mid_call_launched("SIGSTOP", timeout_s=INNER_S))
        """,
    ),
    "torchrun_rank_sigkill_mid_call": (
        "EP2 started as torchrun starts ranks (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, TORCHELASTIC_RUN_ID; "
        "rank 0 serves the hub), both on GPU 0: rank 1 sends itself SIGKILL right after launching a call",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.signal_mid_call_torchrun("SIGKILL", timeout_s=INNER_S))
        """,
    ),
    "torchrun_rank_sigstop_mid_call": (
        "EP2 started as torchrun starts ranks (rank 0 serves the hub), both on GPU 0: rank 1 sends itself SIGSTOP "
        "right after launching a call",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.signal_mid_call_torchrun("SIGSTOP", timeout_s=INNER_S))
        """,
    ),
    "launcher_killed": (
        "EP2 under `megamoe-rt launch`, both ranks on GPU 0 in a loop of calls: SIGKILL to the launcher",
        """
        from megamoe_rt.cli import faults_ep
        outcome, detect, _, seen = faults_ep.launcher_killed(timeout_s=INNER_S)
        try:  # the GPU the killed ranks shared, from a new process (this one)
            later = "yes: a new process's call works on the GPU" if good_call_ok(layer_of()) else "no: WRONG output"
        except Exception as exc:
            later = "no: " + first_line(exc)
        report(outcome, detect, later, seen)
        """,
    ),
    "oom_at_construction_one_rank": (
        "EP2 under `megamoe-rt launch`, both ranks on GPU 0: rank 1 holds all free GPU memory, then both construct "
        "a layer (rank 1 with track_expert_stats, an allocation of its own)",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.oom_at_construction_launched(timeout_s=INNER_S))
        """,
    ),
    "settings_differ_across_ranks": (
        "EP2 under `megamoe-rt launch`, both ranks on GPU 0: rank 1 constructs its layer with swiglu_limit=8, "
        "rank 0 without",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.settings_differ_launched(timeout_s=INNER_S))
        """,
    ),
    "stalled_hub_client": (
        "EP2 under `megamoe-rt launch`, both ranks on GPU 0: 8 clients connect to the hub's socket and never "
        "answer its handshake; then a barrier, an exchange and a layer call",
        """
        from megamoe_rt.cli import faults_ep
        report(*faults_ep.stalled_hub_client_launched(timeout_s=INNER_S))
        """,
    ),
    # --- the kernel cache
    "cache_dir_read_only": (
        "MEGAMOE_RT_CACHE names a directory no entry can be written into (mode 0500; as root, where modes do "
        "not bind: a read-only tmpfs, else /proc/self); then a first layer call, every kernel compiled",
        """
        from megamoe_rt.cli import faults
        report(*faults.cache_fault(faults.read_only_cache_dir(), lambda: good_call_ok(layer_of())))
        """,
    ),
    "cache_dir_full": (
        "MEGAMOE_RT_CACHE on a full file system (as root: a filled 64 KiB tmpfs; else ENOSPC simulated: os.fsync "
        "raises it as the cache writes an entry); then a first layer call, every kernel compiled",
        """
        from megamoe_rt.cli import faults
        report(*faults.cache_fault(faults.full_cache_dir(), lambda: good_call_ok(layer_of())))
        """,
    ),
    # --- streaming
    "producer_never_publishes": (
        "a streamed call (4 slots of 16 tokens, timeout_s=2) whose producer publishes chunks 0, 1 and 3, never 2",
        """
        from megamoe_rt.runtime import driver
        from megamoe_rt.streaming import ChunkWriter, StreamConfig
        from cuda.bindings import driver as cu
        layer = layer_of(streaming=StreamConfig(4, 16), timeout_s=2.0)
        writer = ChunkWriter(layer)  # its kernels load now, not while the layer waits
        a = args_of()
        producer, consumer = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()
        writer.begin_call(stream=producer)
        for chunk in (0, 1, 3):  # chunk 2 (slot 2, generation 0x100000003 of call 1) never comes
            writer.write(chunk, *a, stream=producer)
        t0 = time.monotonic()
        layer.consume(T, stream=consumer)
        try:
            driver.call(cu.cuCtxSynchronize); report("no error", None, None)
        except driver.CudaError as exc:
            text = first_line(exc, 600)
            named = all(part in text for part in ("slot 2", "0x100000003", "half"))
            report(text if named else "WRONG: the error names not slot 2, generation 0x100000003 and the half: " + text,
                   time.monotonic() - t0, "no: the trap ends the CUDA context; restart the process")
        """,
    ),
}

# Seconds each fault may take before it counts as a hang (``--limit`` sets one for all). Each is
# a few times the fault's usual time with a warm kernel cache (the single-process faults took
# about 2 s on an H200; two ranks on one GPU start in about 8 s, a stopped rank is named after
# the 5 s heartbeat timeout). Every fault hanging at once would take them all.
DEFAULT_LIMIT_S = 45.0
_LIMITS: dict[str, float] = {
    "bad_input_one_rank": 90.0,
    "rank_killed_mid_call": 90.0,
    "rank_sigkill_mid_call": 60.0,
    "rank_sigstop_mid_call": 75.0,
    "torchrun_rank_sigkill_mid_call": 60.0,
    "torchrun_rank_sigstop_mid_call": 75.0,
    "launcher_killed": 60.0,
    "oom_at_construction_one_rank": 90.0,
    "settings_differ_across_ranks": 60.0,
    "stalled_hub_client": 60.0,
    "cache_dir_read_only": 60.0,
    "cache_dir_full": 60.0,
}


def limit_for(name: str, limit_s: float | None = None) -> float:
    """The wall-clock limit of fault ``name``: ``limit_s`` when given, else its own."""
    return limit_s if limit_s is not None else _LIMITS.get(name, DEFAULT_LIMIT_S)


def first_line(exc: BaseException, limit: int = 220) -> str:
    """``Type: message`` on one line (the message's lines joined), the message cut at ``limit``."""
    text = " ".join(line.strip() for line in str(exc).splitlines())
    return f"{type(exc).__name__}: {text[:limit]}"


def share_gpu_0() -> None:
    """Ranks started from here on run on GPU 0 (unless the caller chose their GPUs)."""
    os.environ.setdefault("MEGAMOE_RT_RANK_DEVICES", "0")


# The layer the faults across ranks build: hidden, intermediate, experts, top-k, tokens per rank.
EP_SHAPE = (512, 256, 16, 2, 64)


def _ep_layer(ctx):
    import cupy as cp
    import numpy as np

    from megamoe_rt import MegaMoE
    from megamoe_rt import reference as ref

    cp.cuda.Device(ctx.device).use()
    h, i, e, k, t = EP_SHAPE
    w = ref.random_moe_inputs(np.random.default_rng(3), 1, h, i, e, k)
    inp = ref.random_moe_inputs(np.random.default_rng(10 + ctx.rank), t, h, i, e, k)
    layer = MegaMoE(h, i, e, k, t, group=ctx, timeout_s=2.0)
    el = e // ctx.world_size
    own = slice(ctx.rank * el, (ctx.rank + 1) * el)
    layer.load_weights(w["w1"][own], w["w1_sf"][own], w["w2"][own], w["w2_sf"][own])
    args = [
        cp.asarray(inp["x"].view(np.uint8)),
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
    ]
    return layer, args


def bad_input_rank(ctx):
    """Rank 1's x_sf has the wrong shape: every rank must raise the same error, and a good
    call afterwards must run on every rank."""
    layer, args = _ep_layer(ctx)
    bad = list(args)
    if ctx.rank == 1:
        bad[1] = bad[1][:, :1].copy()
    message = "no error"
    try:
        layer(*bad)
    except ValueError as exc:
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    layer(*args)
    layer.synchronize()
    return message, True


def killed_rank(ctx):
    import os

    layer, args = _ep_layer(ctx)
    layer(*args)
    if ctx.rank == 1:
        os._exit(9)  # gone with its call in flight
    layer.synchronize()
    return "finished"


# --- the kernel cache's faults ------------------------------------------------------------------


@dataclass
class CacheDir:
    """A kernel-cache directory with a fault: where it is, how it was made (for the row), what
    removes it, and what to run the layer under (a simulated fault; else nothing)."""

    path: str
    how: str
    cleanup: Callable[[], None]
    fault: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)


def _writable(directory: str) -> bool:
    """Whether this process can create a file in ``directory`` (the probe is removed)."""
    try:
        fd, path = tempfile.mkstemp(dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


def _mount_tmpfs(directory: str, options: str) -> bool:
    """Mount a tmpfs on ``directory`` (root only; a container may still refuse it)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", directory], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _unmount(directory: str) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["umount", "-l", directory], capture_output=True, timeout=10)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def _remove_read_only(directory: str) -> None:
    os.chmod(directory, 0o700)
    os.rmdir(directory)


def read_only_cache_dir() -> CacheDir | None:
    """A directory of this user's that no process here can create a file in: mode 0500; where
    modes do not bind (root), a tmpfs mounted read-only on it, else ``/proc/self`` (procfs lets
    no one create files; it is the process's own, mode 0555). None when neither is to be had."""
    d = tempfile.mkdtemp(prefix="megamoe-rt-ro-cache-")
    os.chmod(d, 0o500)
    if not _writable(d):
        return CacheDir(d, "a directory of mode 0500", lambda: _remove_read_only(d))
    os.chmod(d, 0o700)
    if _mount_tmpfs(d, "ro,size=64k,mode=0700"):
        if not _writable(d):
            return CacheDir(d, "a read-only tmpfs (root: mode 0500 does not bind)", lambda: _unmount(d))
        _unmount(d)
    else:
        os.rmdir(d)
    if os.path.isdir("/proc/self") and not _writable("/proc/self"):
        return CacheDir("/proc/self", "/proc/self (root, and no mount: procfs lets no one create files)", lambda: None)
    return None


def _fill(directory: str) -> None:
    """Write into ``directory`` until its file system has no byte left."""
    with contextlib.suppress(OSError), open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)


@contextlib.contextmanager
def _enospc_on_fsync() -> Iterator[None]:
    """Every ``os.fsync`` raises ENOSPC, as a full disk does when a written file is flushed: the
    cache fsyncs every entry it writes (in this process only, while the context lasts)."""
    real = os.fsync

    def full(fd: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.fsync = full  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def full_cache_dir() -> CacheDir:
    """A directory on a full file system: as root, a 64 KiB tmpfs filled to the last byte; else
    (no mount) a plain directory, the layer run with ENOSPC raised by ``os.fsync``."""
    d = tempfile.mkdtemp(prefix="megamoe-rt-full-cache-")
    if _mount_tmpfs(d, "size=64k,mode=0700"):
        _fill(d)
        return CacheDir(d, "a 64 KiB tmpfs, filled", lambda: _unmount(d))
    return CacheDir(
        d, "ENOSPC simulated: os.fsync raises it (no tmpfs: not root)", lambda: shutil.rmtree(d), _enospc_on_fsync()
    )


def cache_fault(made: CacheDir | None, call: Callable[[], bool]) -> tuple[str, float | None, str | None, list[str]]:
    """Run ``call`` (the layer's first call, which compiles its kernels: none is in the cache)
    with ``$MEGAMOE_RT_CACHE`` at ``made``; the row's fields. Expected: one warning (as the
    warnings filter shows them: a repeated message once) and a call that works."""
    import warnings

    from megamoe_rt.jit.cache import CacheWriteWarning, UntrustedCacheWarning

    if made is None:
        return "not run: no directory here that this process cannot write into", None, None, []
    before = os.environ.get("MEGAMOE_RT_CACHE")
    os.environ["MEGAMOE_RT_CACHE"] = made.path
    try:
        with made.fault, warnings.catch_warnings(record=True) as caught:
            t0 = time.monotonic()
            try:
                ok = call()
                later = "yes" if ok else "no: WRONG output"
            except Exception as exc:
                later = "no: " + first_line(exc)
            took = time.monotonic() - t0
    finally:
        if before is None:
            os.environ.pop("MEGAMOE_RT_CACHE", None)
        else:
            os.environ["MEGAMOE_RT_CACHE"] = before
        made.cleanup()
    lines = [
        " ".join(str(w.message).split())
        for w in caught
        if issubclass(w.category, (CacheWriteWarning, UntrustedCacheWarning))
    ]
    seen = [f"warning: {line[:240]}" for line in lines[:3]] + (
        [f"... {len(lines) - 3} more warnings"] if len(lines) > 3 else []
    )
    if not lines:
        outcome = f"WRONG: no warning ({made.how})"
    elif len(lines) > 1:
        outcome = f"WRONG: {len(lines)} warnings, expected one ({made.how}); the first: {lines[0][:200]}"
    else:
        outcome = f"one warning ({made.how}): {lines[0][:200]}"
    return outcome, took, later, seen


# --- running the faults --------------------------------------------------------------------------


@dataclass
class FaultRow:
    fault: str
    injected: str
    outcome: str
    detect_s: float | None
    later_calls: str | None
    wall_s: float
    hang: bool
    seen: list[str] | None = None  # faults across ranks: what each process saw, one line each


def script_of(name: str, limit_s: float | None = None) -> str:
    """The script fault ``name`` runs in its fresh process. ``INNER_S``: how long the fault's own
    waits may take, a little less than its limit, so that it can still report what it saw."""
    limit = limit_for(name, limit_s)
    inner = max(1.0, min(limit - 10.0, limit * 0.8))
    _, body = _SCENARIOS[name]
    return _PRELUDE + f"LIMIT_S, INNER_S = {limit!r}, {inner!r}\n" + textwrap.dedent(body)


def run_fault(name: str, limit_s: float | None = None) -> FaultRow:
    """Fault ``name`` in a fresh process, under its limit (``limit_s`` when given)."""
    injected, _ = _SCENARIOS[name]
    limit = limit_for(name, limit_s)
    script = script_of(name, limit)
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return FaultRow(name, injected, f"HANG: no result within {limit:g} s", None, None, limit, True)
    wall = time.monotonic() - start
    for line in out.stdout.splitlines():
        if line.startswith("FAULT-RESULT "):
            r = json.loads(line[len("FAULT-RESULT ") :])
            return FaultRow(name, injected, r["outcome"], r["detect_s"], r["later"], wall, False, r.get("seen"))
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return FaultRow(
        name, injected, f"process exited {out.returncode} without a result: {tail}", None, None, wall, False
    )


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def markdown(rows: list[FaultRow]) -> str:
    lines = [
        "| fault | injected | outcome | detected after | later calls work | hang | what each process saw |",
        "|---|---|---|---:|---|---|---|",
    ]
    for r in rows:
        detect = "-" if r.detect_s is None else f"{r.detect_s:.3f} s"
        seen = "<br>".join(_cell(line) for line in r.seen) if r.seen else "-"
        lines.append(
            f"| {r.fault} | {_cell(r.injected)} | {_cell(r.outcome)} | {detect} | {_cell(r.later_calls or '-')} | "
            f"{'yes' if r.hang else 'no'} | {seen} |"
        )
    return "\n".join(lines) + "\n"


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options and the faults to run; a bad option, an unknown fault or a file that cannot
    be written: one line on stderr and SystemExit(2)."""
    ap = Parser(prog="python -m megamoe_rt.cli.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated fault names (default: all)")
    ap.add_argument(
        "--limit",
        type=positive_seconds,
        default=None,
        help="seconds before a fault counts as a hang, for every fault (default: each fault's own, 45-90 s)",
    )
    add_output_options(ap, "the rows")
    ap.add_argument("--md", default=None, metavar="FILE", help="write the table as Markdown to FILE")
    try:
        a = ap.parse_args(argv)
        names = list(_SCENARIOS) if a.only is None else [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in _SCENARIOS]
        if unknown:
            raise UsageError(f"{ap.prog}: unknown fault {unknown[0]!r}; known: {', '.join(_SCENARIOS)}")
        check_output(ap.prog, a)
        check_writable(ap.prog, "--md", a.md)
    except UsageError as exc:
        raise SystemExit(report(exc)) from None
    return a, names


def main(argv: list[str] | None = None) -> int:
    a, names = _arguments(argv)  # bad arguments: one line, SystemExit(2), before the GPU check
    from megamoe_rt.requirements import gpu_or_report

    # Every fault needs the GPU: without one each would run (seconds apiece) only to fail alike.
    if gpu_or_report("python -m megamoe_rt.cli.faults") is None:
        return 1
    rows = []
    with progress_to_stderr(a):
        for name in names:
            row = run_fault(name, a.limit)
            print(f"{row.fault:>30}: {row.outcome} ({row.wall_s:.1f} s)", flush=True)
            rows.append(row)
    emit(a, [asdict(r) for r in rows])
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(rows))
    return 0 if not any(r.hang or r.outcome.startswith(("WRONG", "no error")) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
