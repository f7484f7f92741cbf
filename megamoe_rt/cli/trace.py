"""``megamoe-rt trace``: one call's device-side stage trace as a Chrome / Perfetto trace file.

The fused kernel (and the split pipeline's K1, K2 and K3) can stamp, per block, the
``%globaltimer`` of each stage boundary (``kernels.fused.TRACE_EVENTS``) and the SM the block
ran on. This module turns those stamps into trace events: a process per rank, a track per
(SM, role) -- the block's routing, its dispatch warps, its TMA producer, its math warpgroups,
and, in the split mode, K3's reduce blocks -- with one span per stage. Open the file in
https://ui.perfetto.dev or chrome://tracing.

One GPU: ``megamoe-rt trace --preset flash --tokens 2048 [--mode split] [-o trace.json | --json]``
(the trace file, trace.json by default; ``--json`` prints the trace on stdout instead).
``--stream SLOTSxTOKENS`` traces a streamed call instead (the fused mode, a ChunkWriter producing
on another stream): its dispatch warps stamp when they see the last chunk, and the file's
``otherData`` says how long before that the first L1 tile started.
Across ranks: ``megamoe-rt launch -n 2 -m megamoe_rt.cli.trace --preset flash --tokens 2048``:
every rank traces its own call and rank 0 writes one file with a process per rank. Times are
microseconds from the earliest stamp of any rank; ``%globaltimer`` is the GPU's global
nanosecond timer, so ranks on one node line up to within the timers' agreement.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megamoe_rt.cli.output import add_output_options, check_output, emit, progress_to_stderr
from megamoe_rt.cli.usage import Parser, UsageError, exit_status, positive_int, stream_config
from megamoe_rt.modes.registry import FUSED_KERNEL, KERNEL_STREAMING, SM_PARTITIONED, default_mode

DEFAULT_OUTPUT = "trace.json"  # the file written when neither -o nor --json is given

# (span name, role track, first event, last event): a span is drawn when both stamps exist.
SPANS: tuple[tuple[str, str, str, str], ...] = (
    ("count routes", "routing", "start", "counted"),
    ("lay out and claim rows", "routing", "counted", "claimed"),
    ("dispatch rows", "dispatch warps", "claimed", "dispatch_done"),
    ("chunks arrive, to the last", "dispatch warps", "claimed", "last_chunk"),
    ("load tiles (TMA)", "producer", "claimed", "producer_done"),
    ("to the first L1 tile", "producer", "claimed", "first_l1"),
    ("GEMM tiles", "math", "claimed", "math_done"),
    ("wait for every block's tiles", "math", "math_done", "all_tiles_done"),
    ("combine", "math", "all_tiles_done", "combine_done"),
)
# K3 (the split pipeline's reduce) stamps its start and end only.
REDUCE_SPANS: tuple[tuple[str, str, str, str], ...] = (("reduce (combine)", "reduce", "start", "combine_done"),)
ROLES = ("routing", "dispatch warps", "producer", "math", "reduce")


@dataclass(frozen=True)
class TracedKernel:
    """Rows ``[first_row, first_row + rows)`` of a trace buffer, stamped by kernel ``name``."""

    name: str
    first_row: int
    rows: int
    reduce: bool = False  # stamps only start and end (split K3)


def kernels_of(mode: str, trace_rows: int, sms: tuple[int, int, int] | None = None) -> list[TracedKernel]:
    """Which rows of a layer's trace buffer each kernel stamps (see testing.trace_buffer): the
    fused kernel's blocks stamp every row; on SM partitions K1's, then K2's, then K3's."""
    if mode not in FUSED_KERNEL:
        traced = " or ".join(repr(name) for name in FUSED_KERNEL)
        raise ValueError(f"mode={mode!r}: a trace is recorded by mode {traced}")
    if mode not in SM_PARTITIONED:
        return [TracedKernel(mode, 0, trace_rows)]
    if sms is None:
        raise ValueError(f"mode={mode!r}: the SM split (l1, l2, reduce) is needed to tell K1, K2 and K3 apart")
    l1, l2, _ = sms
    return [
        TracedKernel("K1 dispatch+L1", 0, l1),
        TracedKernel("K2 L2+scatter", l1, l2),
        TracedKernel("K3 reduce", l1 + l2, trace_rows - l1 - l2, reduce=True),
    ]


def trace_events(
    stamps: Any, events: Sequence[str], kernels: Sequence[TracedKernel], *, rank: int, origin_ns: int
) -> list[dict]:
    """Chrome trace events (complete events, "X") of one rank's stamps ``[rows, len(events)]``
    (``events``: the column names, the SM column named ``"sm"``)."""
    col = {e: j for j, e in enumerate(events)}
    out: list[dict] = []
    named: set[int] = set()
    for kernel in kernels:
        spans = REDUCE_SPANS if kernel.reduce else SPANS
        per_sm_reduce: dict[int, int] = {}
        for row in range(kernel.first_row, kernel.first_row + kernel.rows):
            stamp = [int(v) for v in stamps[row]]
            if stamp[col["start"]] == 0:
                continue  # a block that did not run (K3 launches as many as it needs)
            sm = stamp[col["sm"]]
            lane = 0
            if kernel.reduce:  # several K3 blocks share an SM: a track each
                lane = per_sm_reduce.get(sm, 0)
                per_sm_reduce[sm] = lane + 1
            for name, role, first, last in spans:
                t0, t1 = stamp[col[first]], stamp[col[last]]
                if t0 == 0 or t1 == 0 or t1 < t0:
                    continue
                tid = (sm * len(ROLES) + ROLES.index(role)) * 64 + lane
                if tid not in named:
                    named.add(tid)
                    label = f"SM {sm:3d} {role}" + (f" {lane}" if lane else "")
                    out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
                    out.append(
                        {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
                    )
                out.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": kernel.name,
                        "pid": rank,
                        "tid": tid,
                        "ts": (t0 - origin_ns) / 1e3,
                        "dur": (t1 - t0) / 1e3,
                        "args": {"kernel": kernel.name, "block": row - kernel.first_row, "sm": sm},
                    }
                )
    out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
    return out


def earliest_stamp(stamps: Any, events: Sequence[str]) -> int:
    """The earliest nonzero time stamp (ns), 0 if none (the columns before ``"sm"`` are times)."""
    n = events.index("sm")
    times = [int(v) for row in stamps for v in list(row)[:n] if int(v)]
    return min(times) if times else 0


def wait_us_per_block(stamps: Any, events: Sequence[str]) -> dict[str, float]:
    """Each data-wait sum (the ``*_ns`` columns after ``"sm"``) averaged over the blocks that
    ran, in us."""
    col = {e: j for j, e in enumerate(events)}
    ran = [row for row in stamps if int(row[col["start"]])]
    return {
        e.removesuffix("_ns"): (sum(int(row[col[e]]) for row in ran) / len(ran) / 1e3 if ran else 0.0)
        for e in events[events.index("sm") + 1 :]
    }


def chrome_trace(ranks: Sequence[tuple[int, Any, Sequence[TracedKernel]]], events: Sequence[str], meta: dict) -> dict:
    """A whole trace file: ``ranks`` holds (rank, stamps, kernels) per rank."""
    starts = [earliest_stamp(s, events) for _, s, _ in ranks]
    origin = min((t for t in starts if t), default=0)
    out: list[dict] = []
    for rank, stamps, kernels in ranks:
        out += trace_events(stamps, events, kernels, rank=rank, origin_ns=origin)
    return {"traceEvents": out, "displayTimeUnit": "ns", "otherData": meta}


def l1_before_last_chunk_us(stamps: Any, events: Sequence[str]) -> float | None:
    """How long before any block saw a streamed call's last chunk published the first L1 tile
    started (negative: after), in microseconds; None without both stamps."""
    col = {e: j for j, e in enumerate(events)}
    first = [int(r[col["first_l1"]]) for r in stamps if int(r[col["first_l1"]])]
    last = [int(r[col["last_chunk"]]) for r in stamps if int(r[col["last_chunk"]])]
    if not first or not last:
        return None
    return (max(last) - min(first)) / 1e3


def traced_call(
    preset: str, tokens: int, mode: str, *, group: Any = None, streaming: Any = None
) -> tuple[Any, list[TracedKernel], dict]:
    """Build the preset's EP8 per-rank slice (``group``: across its ranks), make one warm call,
    then one traced call; its stamps (host NumPy), kernels and a description. ``streaming``: a
    StreamConfig: the calls are streamed, a ChunkWriter producing on another stream."""
    import cupy as cp

    from megamoe_rt.cli.layer_inputs import rank_inputs
    from megamoe_rt.kernels.fused import TRACE_EVENTS
    from megamoe_rt.layer import MegaMoE
    from megamoe_rt.presets import DEFAULT_EP_RANKS, get_preset
    from megamoe_rt.testing import trace_buffer

    p = get_preset(preset)
    local = p.num_experts // DEFAULT_EP_RANKS
    world = 1 if group is None else group.world_size
    rank = 0 if group is None else group.rank
    args, weights = rank_inputs(cp, rank, tokens, p.hidden, p.intermediate, local * world, local, p.num_topk, tokens)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.get_current_stream().synchronize()  # the inputs, made on CuPy's stream
    layer = MegaMoE(
        p.hidden, p.intermediate, local * world, p.num_topk, tokens, mode=mode, group=group, streaming=streaming
    )
    try:
        layer.load_weights(*weights, stream=stream)
        y = cp.empty((tokens, p.hidden), dtype=cp.uint16)
        call = _streamed_call(layer, args, y, stream) if streaming is not None else None
        with stream:
            (call or functools.partial(layer, *args, out=y, stream=stream))()  # warm: kernels loaded, graphs built
            stream.synchronize()
        with trace_buffer(layer) as stamps, stream:
            (call or functools.partial(layer, *args, out=y, stream=stream))()
            stream.synchronize()
            host = cp.asnumpy(stamps)
        split = getattr(layer.runner, "sms", None)  # SplitMode: the SM counts of K1, K2, K3
        sms = split.as_tuple() if mode in SM_PARTITIONED and split is not None else None
        kernels = kernels_of(mode, host.shape[0], sms)
        meta = {"preset": preset, "tokens_per_rank": tokens, "mode": mode, "ranks": world, "split_sms": sms}
        meta["wait_us_per_block"] = wait_us_per_block(host, TRACE_EVENTS)
        if streaming is not None:
            meta["streaming"] = f"{streaming.num_slots}x{streaming.tokens_per_slot}"
            meta["l1_before_last_chunk_us"] = l1_before_last_chunk_us(host, TRACE_EVENTS)
    finally:
        layer.close()
    return host, kernels, meta


def _streamed_call(layer: Any, args: Sequence[Any], y: Any, stream: Any) -> Any:
    """One streamed call: the layer consumes on ``stream`` while a ChunkWriter produces on
    another stream that ``stream`` then waits for."""
    import cupy as cp

    from megamoe_rt.streaming import ChunkWriter

    writer, producer = ChunkWriter(layer), cp.cuda.Stream(non_blocking=True)

    def call() -> None:
        layer.consume(y.shape[0], out=y, stream=stream)  # enqueued first: waits for its chunks
        writer.write_all(*args, stream=producer)
        stream.wait_event(producer.record())

    return call


def check_arguments(a: argparse.Namespace) -> None:
    """Where the trace goes: ``-o`` (or trace.json without ``-o`` and ``--json``), checked
    writable before the GPU probe (a UsageError naming the option)."""
    if a.output is None and not a.json:
        a.output = DEFAULT_OUTPUT
    stream = getattr(a, "stream", None)
    if stream is not None and a.mode not in KERNEL_STREAMING:
        inside = " or ".join(KERNEL_STREAMING)
        raise UsageError(f"megamoe-rt trace: --stream: a streamed call is traced in --mode {inside}, not {a.mode!r}")
    check_output("megamoe-rt trace", a)


def write_trace(a: argparse.Namespace, trace: dict) -> None:
    """The trace to ``-o`` and, with ``--json``, stdout (one line: a trace is large)."""
    emit(a, trace, indent=None)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from megamoe_rt.presets import PRESETS

    ap.add_argument("--preset", default="flash", choices=sorted(PRESETS))
    ap.add_argument(
        "--tokens", type=positive_int, default=2048, help="tokens per rank (the preset's EP8 per-rank slice)"
    )
    ap.add_argument("--mode", default=default_mode(FUSED_KERNEL), choices=FUSED_KERNEL)
    ap.add_argument(
        "--stream",
        type=stream_config,
        metavar="SLOTSxTOKENS",
        help="trace a streamed call on an input ring of SLOTS slots of TOKENS tokens (one GPU, the fused mode)",
    )
    add_output_options(ap, f"the Chrome trace (default: to {DEFAULT_OUTPUT})")


def main(argv: Sequence[str] | None = None) -> int:
    """Across ranks (under ``megamoe-rt launch``): every rank traces, rank 0 writes the file."""
    ap = Parser(prog="megamoe_rt.cli.trace", description=__doc__.splitlines()[0])
    add_arguments(ap)

    def command() -> int:
        a = ap.parse_args(argv)
        check_arguments(a)
        return _main(a)

    return exit_status(command)


def _main(a: argparse.Namespace) -> int:
    from megamoe_rt.ep.launch import context_from_env, launched
    from megamoe_rt.kernels.fused import TRACE_EVENTS
    from megamoe_rt.requirements import gpu_or_report

    if not launched():
        return 1 if gpu_or_report("megamoe-rt trace") is None else run(a)
    if a.stream is not None:  # before any rank starts NVSHMEM
        raise UsageError("megamoe-rt trace: --stream: one GPU only (across ranks a streamed layer runs chunk calls)")
    from megamoe_rt.ep.symm import NvshmemRuntime

    ctx = context_from_env()
    if gpu_or_report("megamoe-rt trace", ctx.device) is None:  # one line for the launcher to print once
        return 1
    import cupy as cp

    cp.cuda.Device(ctx.device).use()
    with progress_to_stderr(a):
        stamps, kernels, meta = traced_call(a.preset, a.tokens, a.mode, group=ctx, streaming=a.stream)
    mine = json.dumps({"stamps": stamps.tolist(), "kernels": [asdict(k) for k in kernels]}).encode()
    everyone = [
        json.loads(ctx.broadcast(mine if ctx.rank == r else None, key="trace", root=r)) for r in range(ctx.world_size)
    ]
    if ctx.rank == 0:
        ranks = [(r, e["stamps"], [TracedKernel(**k) for k in e["kernels"]]) for r, e in enumerate(everyone)]
        write_trace(a, chrome_trace(ranks, TRACE_EVENTS, meta))
        if a.output:
            with progress_to_stderr(a):
                print(f"wrote {a.output}: {a.mode}, {a.preset}, {a.tokens} tokens per rank, {ctx.world_size} ranks")
    NvshmemRuntime.initialize(ctx).finalize()
    return 0


def run(a: argparse.Namespace) -> int:
    """One GPU: trace one call and write the file."""
    from megamoe_rt.kernels.fused import TRACE_EVENTS

    check_arguments(a)
    with progress_to_stderr(a):
        stamps, kernels, meta = traced_call(a.preset, a.tokens, a.mode, streaming=a.stream)
    trace = chrome_trace([(0, stamps, kernels)], TRACE_EVENTS, meta)
    write_trace(a, trace)
    spans = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    if a.output:
        with progress_to_stderr(a):
            print(f"wrote {a.output}: {a.mode}, {a.preset}, {a.tokens} tokens, {spans} spans (open in ui.perfetto.dev)")
    waits = meta["wait_us_per_block"]
    if a.output and waits:
        with progress_to_stderr(a):
            print("data waits per block (us): " + ", ".join(f"{k} {v:.1f}" for k, v in waits.items()))
    ahead = meta.get("l1_before_last_chunk_us")
    if ahead is not None:
        with progress_to_stderr(a):
            print(f"streamed: the first L1 tile started {ahead:.1f} us before the last chunk was seen published")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
