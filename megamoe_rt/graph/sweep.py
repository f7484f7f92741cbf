"""Partition sweeps: run a pipeline spec's graph at each SM split of one partition and
time every node alone (in its partition) and the whole graph. Without a partition to vary,
the spec runs once with the partition sizes it names."""

from __future__ import annotations

import re
import statistics
import sys
from typing import Any

from megamoe_rt.graph.spec import PipelineSpec, SpecError

_VARY = re.compile(r"^(?P<name>[A-Za-z_][\w-]*)=(?P<start>\d+)\.\.(?P<stop>\d+)(?::(?P<step>\d+))?$")


def parse_vary(text: str) -> tuple[str, list[int]]:
    """``name=start..stop[:step]`` (inclusive) -> (name, values)."""
    m = _VARY.match(text.strip())
    if not m:
        raise ValueError(f"--vary {text!r}: expected NAME=START..STOP[:STEP], e.g. left=8..128:8")
    start, stop, step = int(m["start"]), int(m["stop"]), int(m["step"] or 8)
    if step <= 0 or start <= 0 or stop < start:
        raise ValueError(f"--vary {text!r}: expected 0 < START <= STOP and STEP > 0")
    return m["name"], list(range(start, stop + 1, step))


def _time_graph(graph, stream, reps: int) -> float:
    import cupy as cp

    graph.launch(stream.ptr)
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream.ptr)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times)


def sweep_points(spec: PipelineSpec, vary: str | None, values: list[int] | None) -> list[tuple[Any, list]]:
    """``(value, partition requests)`` of every point: one per value of the varied partition,
    or, with ``vary`` None, the spec's own sizes once (value None)."""
    if vary is None:
        return [(None, list(spec.partitions))]
    if vary not in {n for n, _ in spec.partitions}:
        raise SpecError(
            f"--vary names partition {vary!r}; spec {spec.name!r} has {', '.join(n for n, _ in spec.partitions)}"
        )
    return [(v, [(n, v if n == vary else r) for n, r in spec.partitions]) for v in values or []]


def run_sweep(
    spec: PipelineSpec,
    vary: str | None,
    values: list[int] | None,
    *,
    device: int = 0,
    reps: int = 10,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per point of :func:`sweep_points` (``vary`` None: the spec once, as written)."""
    import cupy as cp

    from megamoe_rt.graph.builder import GraphBuilder
    from megamoe_rt.graph.green import GreenPartitions
    from megamoe_rt.graph.workloads import make_workload

    points = sweep_points(spec, vary, values)
    order = spec.topological_order()
    workloads = {n.name: make_workload(n, device) for n in order}
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for i, (v, requests) in enumerate(points):
        if progress:
            what = "partitions as specified" if vary is None else f"{vary}={v}"
            print(f"\r[{i + 1}/{len(points)}] {what} ...", end="", file=sys.stderr, flush=True)
        try:
            parts = GreenPartitions(requests, device=device)
        except ValueError as exc:
            rows.append({"value": v, "error": str(exc)})
            continue
        with parts:
            row: dict[str, Any] = {
                "value": v,
                "partitions": {n: p.sm_count for n, p in parts.partitions.items()},
                "nodes_us": {},
            }
            for node in order:
                w = workloads[node.name]
                g = GraphBuilder()
                try:
                    g.add_kernel(w.kernel, (w.grid,), (w.block,), w.args, ctx=parts[node.partition].ctx, smem=w.smem)
                    g.instantiate()
                    row["nodes_us"][node.name] = _time_graph(g, stream, reps)
                finally:
                    g.close()
            g = GraphBuilder()
            try:
                made: dict[str, Any] = {}
                for node in order:
                    w = workloads[node.name]
                    made[node.name] = g.add_kernel(
                        w.kernel,
                        (w.grid,),
                        (w.block,),
                        w.args,
                        ctx=parts[node.partition].ctx,
                        smem=w.smem,
                        deps=[made[d] for d in node.deps],
                    )
                g.instantiate()
                row["total_us"] = _time_graph(g, stream, reps)
            finally:
                g.close()
            rows.append(row)
    if progress:
        print(file=sys.stderr)
    return rows


def format_table(rows: list[dict], vary: str | None) -> str:
    ok = [r for r in rows if "error" not in r]
    nodes = list(ok[0]["nodes_us"]) if ok else []
    head = (
        f"{vary or 'run':>6} "
        + " ".join(f"{'SMs ' + n:>12}" for n in (ok[0]["partitions"] if ok else []))
        + " "
        + " ".join(f"{n + ' us':>14}" for n in nodes)
        + f" {'total us':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        label = "spec" if r["value"] is None else str(r["value"])
        if "error" in r:
            lines.append(f"{label:>6} skipped: {r['error']}")
            continue
        lines.append(
            f"{label:>6} "
            + " ".join(f"{s:>12}" for s in r["partitions"].values())
            + " "
            + " ".join(f"{r['nodes_us'][n]:>14.1f}" for n in nodes)
            + f" {r['total_us']:>10.1f}"
        )
    return "\n".join(lines)
