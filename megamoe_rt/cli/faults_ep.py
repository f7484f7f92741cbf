"""The fault suite's faults across ranks (megamoe_rt/cli/faults.py lists and runs them).

A fault's process calls a *driver* here. It starts two ranks, both on GPU 0 (``--devices 0``: they
time-share it, so the times say when an error came, not how fast a call is), under
``megamoe-rt launch`` or as two processes with the variables torchrun gives its workers
(:func:`start_torchrun_like`), injects the fault and returns the row's fields:
``(outcome, detect_s, later, seen)``.

Each rank runs ``python -m megamoe_rt.cli.faults_ep BODY OUT_DIR [ARGS]``: BODY names one of the
*rank bodies* below (module-level functions taking the rank's context), which leave what their
rank saw in ``OUT_DIR/<name>.json`` (a *note*) before they raise or end; an error a body did not
expect is noted as ``error-<rank>``. Times across processes are ``time.time()`` (one host).

Every process started here gets SIGKILL when the process that started it dies (Linux
``PR_SET_PDEATHSIG``): a fault that hangs past its limit, its process killed by the suite,
leaves no rank behind.

``kind="host"`` puts :class:`HostCalls` in the layer's place: a call and a synchronize are the
group's exchanges, as the layer's are, so the suite's CPU tests run the launchers, the signals
and the notes without a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from megamoe_rt.cli.faults import EP_SHAPE, _ep_layer, first_line
from megamoe_rt.ep import liveness
from megamoe_rt.ep.env import LAUNCH_REPORT_ENV, RANK_DEVICES_ENV
from megamoe_rt.ep.rendezvous import RENDEZVOUS_DIR_ENV

RANKS = 2
DEVICES = "0"  # every rank on GPU 0
VICTIM = 1  # the rank the fault happens to
NO_ERROR = "no error"
# What the launchers promise: a rank that dies or is stopped is named on the others within this.
REPORTED_WITHIN_S = 10.0
STALLED_CLIENTS = 8
# The variables `megamoe-rt launch` gives its ranks: a torchrun-like rank must not have them.
_LAUNCH_VARS = (
    "MEGAMOE_RT_RANK",
    "MEGAMOE_RT_WORLD_SIZE",
    "MEGAMOE_RT_HUB",
    "MEGAMOE_RT_HUB_KEY",
    liveness.LAUNCHER_PID_ENV,
    LAUNCH_REPORT_ENV,
)

Row = tuple[str, float | None, str | None, list[str]]  # outcome, detect_s, later, seen


# --- notes -------------------------------------------------------------------------------------


def note(out_dir: str, name: str, **fields: Any) -> None:
    """Leave ``fields`` as ``OUT_DIR/<name>.json`` (written whole: a reader never sees half)."""
    path = os.path.join(out_dir, f"{name}.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, path)


def read_notes(out_dir: str) -> dict[str, dict[str, Any]]:
    notes: dict[str, dict[str, Any]] = {}
    for entry in sorted(os.listdir(out_dir)):
        if entry.endswith(".json"):
            try:
                with open(os.path.join(out_dir, entry)) as f:
                    notes[entry[: -len(".json")]] = json.load(f)
            except (OSError, ValueError):
                pass
    return notes


def _error_lines(notes: dict[str, dict[str, Any]]) -> list[str]:
    return [f"rank {k[len('error-') :]}: {v.get('seen')}" for k, v in notes.items() if k.startswith("error-")]


# --- rank bodies -------------------------------------------------------------------------------


class HostCalls:
    """Stands in for a layer where there is no GPU: a call and a synchronize are the group's
    exchanges, as the layer's are (megamoe_rt/ep/agreement.py)."""

    def __init__(self, ctx: Any):
        self.ctx = ctx

    def __call__(self, *args: Any) -> None:
        self.ctx.allgather(b"call", key="call-status")

    def synchronize(self) -> None:
        self.ctx.allgather(b"sync", key="synchronize")


def _layer(ctx: Any, kind: str) -> tuple[Any, list[Any]]:
    if kind == "host":
        return HostCalls(ctx), []
    if kind != "layer":
        raise ValueError(f"kind: expected 'layer' or 'host', got {kind!r}")
    return _ep_layer(ctx)


class _Stopped(Exception):
    """SIGTERM came (the launcher stopping this rank) before the rank saw any error."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Stopped("SIGTERM (the launcher stopped this rank) before any error")


def _calls_until_error(layer: Any, args: list[Any], calls: int) -> tuple[str, float]:
    """Up to ``calls`` calls, each waited for; the first error (one line) and when it came."""
    try:
        for _ in range(calls):
            layer(*args)
            layer.synchronize()
    except Exception as exc:
        return first_line(exc), time.time()
    return NO_ERROR, time.time()


def signal_mid_call(ctx: Any, out_dir: str, sig_name: str, kind: str = "layer") -> None:
    """Every rank makes a call; then rank VICTIM launches another and sends itself ``sig_name``
    while the others are in that call (their synchronize waits for it). The others note what
    they saw and when."""
    sig = signal.Signals[sig_name]
    layer, args = _layer(ctx, kind)
    layer(*args)
    layer.synchronize()  # every kernel loaded, one call made on every rank
    ctx.barrier()
    if ctx.rank == VICTIM:
        layer(*args)  # its part of the call's exchange posted, its kernels in flight
        note(out_dir, "victim", t=time.time(), pid=os.getpid(), signal=sig_name)
        os.kill(os.getpid(), sig)
        time.sleep(300)  # a stopped rank is here until the launcher (or the suite) ends it
        return
    signal.signal(signal.SIGTERM, _on_sigterm)  # a stop before any error is noted as such
    seen, t = _calls_until_error(layer, args, calls=3)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # from here a stop ends the rank, wherever it is
    note(out_dir, str(ctx.rank), seen=seen, t=t)
    if seen != NO_ERROR:
        raise SystemExit(1)


def call_loop(ctx: Any, out_dir: str, kind: str = "layer", seconds: str = "120") -> None:
    """One call, a note (``ready-<rank>``: pid and start time), then calls for ``seconds``."""
    layer, args = _layer(ctx, kind)
    layer(*args)
    layer.synchronize()
    hub = getattr(ctx, "hub_address", None)
    note(out_dir, f"ready-{ctx.rank}", pid=os.getpid(), start=liveness.own_start_time(), t=time.time(), hub=hub)
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        layer(*args)
        layer.synchronize()
    note(out_dir, f"done-{ctx.rank}", t=time.time())


def _timed(ctx: Any, layer: Any, args: list[Any]) -> dict[str, float]:
    out = {}
    t = time.monotonic()
    ctx.barrier()
    out["barrier"] = time.monotonic() - t
    t = time.monotonic()
    ctx.allgather(b"x", key="faults-exchange")
    out["exchange"] = time.monotonic() - t
    t = time.monotonic()
    layer(*args)
    layer.synchronize()
    out["call"] = time.monotonic() - t
    return out


def stalled_client(ctx: Any, out_dir: str, kind: str = "layer", clients: str = str(STALLED_CLIENTS)) -> None:
    """A barrier, an exchange and a call timed; then rank 0 opens ``clients`` connections to the
    hub's socket that never answer its handshake, and the same are timed again while those
    connections wait (the hub gives a handshake 10 s)."""
    layer, args = _layer(ctx, kind)
    layer(*args)
    layer.synchronize()
    before = _timed(ctx, layer, args)
    stalled = []
    if ctx.rank == 0:
        for _ in range(int(clients)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(ctx.hub_address)  # and never a byte: the hub's challenge goes unanswered
            stalled.append(s)
    ctx.barrier()  # the stalled clients are connected before any rank times
    after = _timed(ctx, layer, args)
    note(out_dir, str(ctx.rank), before=before, after=after, clients=len(stalled))
    for s in stalled:
        s.close()


def _good_call(ctx: Any) -> str:
    try:
        layer, args = _ep_layer(ctx)
        layer(*args)
        layer.synchronize()
    except Exception as exc:
        return "no: " + first_line(exc)
    return "yes"


def settings_differ(ctx: Any, out_dir: str, kind: str = "layer") -> None:
    """Rank VICTIM constructs its layer with ``swiglu_limit=8``, the others without; then every
    rank constructs one alike and calls it."""
    import cupy as cp

    from megamoe_rt import MegaMoE

    cp.cuda.Device(ctx.device).use()
    t0 = time.monotonic()
    try:
        MegaMoE(*EP_SHAPE, group=ctx, timeout_s=2.0, swiglu_limit=8.0 if ctx.rank == VICTIM else None)
        seen = NO_ERROR
    except Exception as exc:
        seen = first_line(exc, 400)
    took = time.monotonic() - t0
    note(out_dir, str(ctx.rank), seen=seen, took=took, later=_good_call(ctx))


def hold_device_memory(floor: int = 512) -> list[Any]:
    """Allocate every byte of free device memory there is (raw allocations, down to ``floor``
    bytes, CuPy's cached blocks given back first), then every byte CuPy's pool still has free
    inside chunks it keeps (a chunk partly in use is never given back, and serves small arrays
    without asking the driver); what is held, for :func:`release`."""
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    held: list[Any] = []
    for alloc, failed in (
        (cp.cuda.runtime.malloc, cp.cuda.runtime.CUDARuntimeError),
        (cp.cuda.alloc, cp.cuda.memory.OutOfMemoryError),
    ):
        size = 1 << 36
        while size >= floor:
            try:
                held.append(alloc(size))
            except failed:
                size //= 2
    return held


def release(held: list[Any]) -> None:
    import cupy as cp

    for block in held:
        if isinstance(block, int):  # a raw allocation; the pool's blocks go back as they are dropped
            cp.cuda.runtime.free(block)
    held.clear()


def oom_at_construction(ctx: Any, out_dir: str, kind: str = "layer") -> None:
    """Rank VICTIM holds every free byte of the GPU, then every rank constructs a layer.

    Ranks on one GPU share its memory, and the symmetric heap grows on every rank alike, so
    before the fault every rank constructs a layer, calls it and keeps it (NVSHMEM started, the
    kernels loaded), then constructs one more and closes it (a buffer's worth of heap, mapped
    and free again for the next layer). The layer then needs new memory only where a rank
    allocates for itself: ``track_expert_stats``, on rank VICTIM. The first layer's call after
    the memory is given back says whether the ranks can go on."""
    from megamoe_rt import MegaMoE

    layer, args = _ep_layer(ctx)
    layer(*args)
    layer.synchronize()
    MegaMoE(*EP_SHAPE, group=ctx, timeout_s=2.0).close()
    ctx.barrier()
    held = hold_device_memory() if ctx.rank == VICTIM else []
    ctx.barrier()
    t0 = time.monotonic()
    try:
        MegaMoE(*EP_SHAPE, group=ctx, timeout_s=2.0, track_expert_stats=ctx.rank == VICTIM)
        seen = NO_ERROR
    except Exception as exc:
        seen = first_line(exc, 400)
    took = time.monotonic() - t0
    release(held)
    ctx.barrier()
    try:
        layer(*args)
        layer.synchronize()
        later = "yes"
    except Exception as exc:
        later = "no: " + first_line(exc)
    note(out_dir, str(ctx.rank), seen=seen, took=took, later=later, held=len(held))


RANK_BODIES: dict[str, Callable[..., None]] = {
    fn.__name__: fn for fn in (signal_mid_call, call_loop, stalled_client, settings_differ, oom_at_construction)
}


# --- starting the ranks ------------------------------------------------------------------------


@contextlib.contextmanager
def scratch_dir() -> Iterator[str]:
    """A directory for the ranks' notes, removed afterwards."""
    path = tempfile.mkdtemp(prefix="megamoe-rt-fault-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_hub_dir(address: str | None) -> None:
    """The directory a killed launcher's hub leaves behind (its socket and board)."""
    if not address:
        return
    directory = os.path.dirname(address)
    if os.path.basename(directory).startswith("megamoe-rt-") and os.path.isdir(directory):
        shutil.rmtree(directory, ignore_errors=True)


def rank_command(body: Callable[..., None], out_dir: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megamoe_rt.cli.faults_ep", body.__name__, out_dir, *args]


def launch_command(body: Callable[..., None], out_dir: str, args: list[str], timeout_s: float) -> list[str]:
    """``megamoe-rt launch`` of ``body`` on two ranks, both on GPU 0, stopped after ``timeout_s``."""
    return [
        sys.executable,
        "-m",
        "megamoe_rt",
        "launch",
        "-n",
        str(RANKS),
        "--devices",
        DEVICES,
        "--timeout",
        f"{max(1.0, timeout_s):g}",
        "-m",
        *rank_command(body, out_dir, args)[2:],
    ]


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _launcher_line(stderr: str) -> str:
    """The launcher's own last line (``megamoe-rt launch: ...``), else the last line at all."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("megamoe-rt launch:")]
    return ((own or lines or ["(nothing on stderr)"])[-1])[:240]


def run_launched(body: Callable[..., None], out_dir: str, args: list[str], timeout_s: float) -> str:
    """Run ``body`` under ``megamoe-rt launch``; one line on how the launcher ended. The
    launcher stops its ranks at ``timeout_s - 7`` (its teardown takes up to 6 s); at
    ``timeout_s`` it is killed, and its ranks with it."""
    cmd = launch_command(body, out_dir, args, timeout_s - 7.0)
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=liveness.preexec_die_with_parent()
        )
    except subprocess.TimeoutExpired as exc:
        return f"launcher: still running after {timeout_s:g} s, killed; {_launcher_line(_text(exc.stderr))}"
    return f"launcher: exit status {done.returncode}: {_launcher_line(done.stderr)}"


def torchrun_env(rank: int, rendezvous_dir: str, run_id: str) -> dict[str, str]:
    """What torchrun gives worker ``rank`` of a one-node job (megamoe_rt/ep/rendezvous.py reads
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and TORCHELASTIC_RUN_ID or GROUP_RANK as
    torchrun's markers; the run id, master address and port name the rendezvous file), both
    ranks on GPU 0, without the variables of a ``megamoe-rt launch`` this may run under."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(RANKS),
        LOCAL_WORLD_SIZE=str(RANKS),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
    )
    env[RANK_DEVICES_ENV] = DEVICES
    env[RENDEZVOUS_DIR_ENV] = rendezvous_dir
    return env


def start_torchrun_like(body: Callable[..., None], out_dir: str, args: list[str]) -> tuple[list[Any], str]:
    """Start ``body`` as two processes the way torchrun starts workers (no torchrun: its
    rendezvous is only the variables, :func:`torchrun_env`); their output goes to
    ``OUT_DIR/stderr-<rank>.txt``. The processes and the rendezvous directory (``mkdtemp``: the
    user's, mode 0700, as the rendezvous requires)."""
    rendezvous = tempfile.mkdtemp(prefix="megamoe-rt-rdzv-")
    run_id = f"megamoe-rt-faults-{uuid.uuid4().hex[:12]}"
    procs = []
    for r in range(RANKS):
        with open(os.path.join(out_dir, f"stderr-{r}.txt"), "w") as log:
            procs.append(
                subprocess.Popen(
                    rank_command(body, out_dir, args),
                    env=torchrun_env(r, rendezvous, run_id),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=liveness.preexec_die_with_parent(),
                )
            )
    return procs, rendezvous


def _last_output_line(out_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(out_dir, f"stderr-{rank}.txt"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:240] if lines else ""


def end_torchrun_like(procs: list[Any], out_dir: str, grace_s: float = 3.0) -> list[str]:
    """Let the processes end on their own for ``grace_s`` (torchrun would stop the group once a
    worker failed), then kill those left; a line per process on how it ended."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    lines = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()  # SIGKILL ends a stopped process too
            p.wait()
            lines.append(f"rank {r} process: still there after {grace_s:g} s; the suite killed it")
        else:
            code = p.returncode
            tail = _last_output_line(out_dir, r) if code else ""
            lines.append(
                f"rank {r} process: exit status {code}{liveness.signal_note(code)}" + (f": {tail}" if tail else "")
            )
    return lines


def _wait_for(done: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if done():
            return True
        time.sleep(poll_s)
    return done()


# --- drivers -----------------------------------------------------------------------------------


def _signal_row(sig_name: str, notes: dict[str, dict[str, Any]], tail: list[str]) -> Row:
    victim, survivor = notes.get("victim"), notes.get("0")
    later = "no: the launch is over; restart it"
    seen = []
    detect = None
    if survivor is not None and victim is not None:
        detect = survivor["t"] - victim["t"]
        seen.append(f"rank 0: {survivor['seen']} ({detect:.2f} s after rank {VICTIM}'s {sig_name})")
    elif survivor is not None:
        seen.append(f"rank 0: {survivor['seen']}")
    if victim is not None:
        seen.append(f"rank {VICTIM}: sent itself {sig_name} right after launching a call")
    seen += _error_lines(notes) + tail
    if victim is None:
        return f"WRONG: rank {VICTIM} did not get to the fault (see what each process saw)", None, None, seen
    if survivor is None:
        return "WRONG: rank 0 left no note of what it saw", None, later, seen
    text = survivor["seen"]
    assert detect is not None
    if text == NO_ERROR:
        outcome = f"no error: rank 0's calls completed after rank {VICTIM}'s {sig_name}"
    elif f"rank {VICTIM}" not in text:
        outcome = f"WRONG: rank 0's error does not name rank {VICTIM}: {text}"
    elif detect > REPORTED_WITHIN_S:
        outcome = f"WRONG: named after {detect:.1f} s, more than {REPORTED_WITHIN_S:g} s: {text}"
    else:
        outcome = f"rank 0: {text}"
    return outcome, detect, later, seen


def signal_mid_call_launched(sig_name: str, *, kind: str = "layer", timeout_s: float = 50.0) -> Row:
    """Rank 1 of a ``megamoe-rt launch`` sends itself ``sig_name`` inside a call (:func:`signal_mid_call`)."""
    with scratch_dir() as out:
        ended = run_launched(signal_mid_call, out, [sig_name, kind], timeout_s)
        return _signal_row(sig_name, read_notes(out), [ended])


def signal_mid_call_torchrun(sig_name: str, *, kind: str = "layer", timeout_s: float = 50.0) -> Row:
    """The same with the ranks started as torchrun starts them: rank 0 serves the hub, and no
    launcher of ours watches the ranks (the suite ends those left, as torchrun would)."""
    with scratch_dir() as out:
        procs, rendezvous = start_torchrun_like(signal_mid_call, out, [sig_name, kind])
        try:
            _wait_for(lambda: "0" in read_notes(out) or all(p.poll() is not None for p in procs), timeout_s - 5.0)
        finally:
            ended = end_torchrun_like(procs, out)
            shutil.rmtree(rendezvous, ignore_errors=True)
        return _signal_row(sig_name, read_notes(out), ended)


def launcher_killed(*, kind: str = "layer", timeout_s: float = 50.0, gone_within_s: float = 10.0) -> Row:
    """SIGKILL to a ``megamoe-rt launch`` whose ranks are in a loop of calls (:func:`call_loop`);
    how long until each rank's process is gone (ended, or a zombie no one reaps)."""
    with scratch_dir() as out:
        log_path = os.path.join(out, "launcher.txt")
        with open(log_path, "w") as log:
            launcher = subprocess.Popen(
                launch_command(call_loop, out, [kind], timeout_s),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=liveness.preexec_die_with_parent(),
            )
        try:
            ready = _wait_for(
                lambda: all(f"ready-{r}" in read_notes(out) for r in range(RANKS)) or launcher.poll() is not None,
                timeout_s - gone_within_s - 5.0,
            )
            notes = read_notes(out)
            if launcher.poll() is not None or not ready:
                with open(log_path, errors="replace") as f:
                    line = _launcher_line(f.read())
                status = "still running" if launcher.poll() is None else f"exit status {launcher.returncode}"
                seen = _error_lines(notes) + [f"launcher: {status}: {line}"]
                return "WRONG: the ranks did not start their loop of calls", None, None, seen
            time.sleep(0.5)  # well inside the loop
            ranks = {r: (notes[f"ready-{r}"]["pid"], notes[f"ready-{r}"]["start"]) for r in range(RANKS)}
            launcher.kill()
            gone = _watch_gone(ranks, gone_within_s)
            launcher.wait()
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        _remove_hub_dir(notes["ready-0"].get("hub"))  # the killed launcher could not
    left = sorted(set(ranks) - set(gone))
    seen = [f"rank {r}: gone {s:.3f} s after the launcher's SIGKILL" for r, s in sorted(gone.items())]
    seen += [f"rank {r}: running {gone_within_s:g} s after the launcher's SIGKILL; the suite killed it" for r in left]
    if left:
        return f"WRONG: rank(s) {left} outlived the launcher by {gone_within_s:g} s", None, None, seen
    last = max(gone.values())
    return f"every rank gone within {last:.3f} s of the launcher's SIGKILL", last, None, seen


def _watch_gone(ranks: dict[int, tuple[int, int | None]], within_s: float) -> dict[int, float]:
    """Seconds until each rank's process (pid, start time) was gone; one still there after
    ``within_s`` is missing from the answer, and killed (by pid, checked against its start)."""
    t0 = time.monotonic()
    gone: dict[int, float] = {}
    while len(gone) < len(ranks) and time.monotonic() - t0 < within_s:
        for r, (pid, start) in ranks.items():
            if r not in gone and liveness.process_state(pid, start) == "gone":
                gone[r] = time.monotonic() - t0
        time.sleep(0.005)
    for r, (pid, start) in ranks.items():
        if r not in gone and liveness.process_state(pid, start) != "gone":
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return gone


def _every_rank_row(notes: dict[str, dict[str, Any]], tail: list[str], expect_type: str | None) -> Row:
    """The row of a fault every rank must raise alike: ``every rank: <error>``, else WRONG."""
    per = {r: notes.get(str(r)) for r in range(RANKS)}
    seen = [f"rank {r}: {n['seen']} ({n['took']:.2f} s)" for r, n in per.items() if n is not None]
    seen += [f"rank {r}: later call: {n['later']}" for r, n in per.items() if n is not None and n["later"] != "yes"]
    seen += _error_lines(notes) + tail
    missing = [r for r, n in per.items() if n is None]
    if missing:
        return f"WRONG: rank(s) {missing} left no note of what they saw", None, None, seen
    texts = {n["seen"] for n in per.values() if n is not None}
    detect = max(n["took"] for n in per.values() if n is not None)
    later = "yes" if all(n["later"] == "yes" for n in per.values() if n is not None) else "no (see each rank)"
    text = next(iter(texts))
    if len(texts) > 1:
        outcome = "WRONG: the ranks raised different errors (see each rank)"
    elif text == NO_ERROR:
        outcome = "no error: every rank's construction went through"
    elif expect_type is not None and not text.startswith(f"{expect_type}:"):
        outcome = f"WRONG: every rank raised, but not a {expect_type}: {text}"
    elif f"rank {VICTIM}" not in text:
        outcome = f"WRONG: the error does not name rank {VICTIM}: {text}"
    else:
        outcome = f"every rank: {text}"
    return outcome, detect, later, seen


def settings_differ_launched(*, timeout_s: float = 50.0) -> Row:
    """:func:`settings_differ` under ``megamoe-rt launch``: every rank must raise one ValueError."""
    with scratch_dir() as out:
        ended = run_launched(settings_differ, out, ["layer"], timeout_s)
        return _every_rank_row(read_notes(out), [ended], "ValueError")


def oom_at_construction_launched(*, timeout_s: float = 80.0) -> Row:
    """:func:`oom_at_construction` under ``megamoe-rt launch``: every rank must raise, naming rank 1."""
    with scratch_dir() as out:
        ended = run_launched(oom_at_construction, out, ["layer"], timeout_s)
        notes = read_notes(out)
    outcome, detect, later, seen = _every_rank_row(notes, [ended], None)
    n = notes.get(str(VICTIM))
    if n is not None:
        seen.append(f"rank {VICTIM} held {n['held']} allocations, every free byte")
    if outcome.startswith("every rank") and f"failed on rank {VICTIM}" not in outcome:
        outcome += " (rank 0's allocation failed too: the ranks share the GPU's memory)"
    return outcome, detect, later, seen


def stalled_hub_client_launched(
    *, kind: str = "layer", timeout_s: float = 50.0, clients: int = STALLED_CLIENTS, slow_s: float = 5.0
) -> Row:
    """:func:`stalled_client` under ``megamoe-rt launch``: the timed steps must not wait for the
    stalled clients (a handshake waited for would take the hub's 10 s)."""
    with scratch_dir() as out:
        ended = run_launched(stalled_client, out, [kind, str(clients)], timeout_s)
        notes = read_notes(out)
    per = {r: notes.get(str(r)) for r in range(RANKS)}
    seen = []
    for r, n in per.items():
        if n is not None:
            a, b = n["after"], n["before"]
            seen.append(
                f"rank {r}: barrier {a['barrier']:.4f} s, exchange {a['exchange']:.4f} s, call {a['call']:.4f} s "
                f"(before the clients: {b['barrier']:.4f} / {b['exchange']:.4f} / {b['call']:.4f} s)"
            )
    seen += _error_lines(notes) + [ended]
    if any(n is None for n in per.values()):
        return "WRONG: a rank did not complete its steps with the stalled clients there", None, None, seen
    slowest = max(max(n["after"].values()) for n in per.values() if n is not None)
    step = {k: max(n["after"][k] for n in per.values() if n is not None) for k in ("barrier", "exchange", "call")}
    text = (
        f"with {clients} stalled clients: barrier {step['barrier']:.4f} s, exchange {step['exchange']:.4f} s, "
        f"call {step['call']:.4f} s (slowest rank)"
    )
    outcome = f"WRONG: a step took {slowest:.1f} s, {text}" if slowest > slow_s else f"calls complete {text}"
    return outcome, None, "yes", seen


# --- a rank ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m megamoe_rt.cli.faults_ep BODY OUT_DIR [ARGS]``, in a rank a launcher started."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in RANK_BODIES:
        print(
            f"usage: python -m megamoe_rt.cli.faults_ep {{{','.join(RANK_BODIES)}}} OUT_DIR [ARGS]: "
            "one rank of a fault of the fault suite (python -m megamoe_rt.cli.faults), under a launcher",
            file=sys.stderr,
        )
        return 2
    name, out_dir, *rest = argv
    from megamoe_rt.ep.launch import context_from_env

    ctx = context_from_env()
    try:
        RANK_BODIES[name](ctx, out_dir, *rest)
    except Exception as exc:
        note(out_dir, f"error-{ctx.rank}", seen=first_line(exc), t=time.time())
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
