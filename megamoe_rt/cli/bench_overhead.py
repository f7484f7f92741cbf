"""``megamoe-rt bench overhead``: what an eager layer call costs against its graph replay.

A call of the layer must cost about what replaying it from a CUDA graph costs: nothing on its
path may wait for the device, and the host work of a call (argument checks, parameter structs,
launches) must hide behind the device work of the calls before it. Measured as a stream of
``calls`` back-to-back calls between two CUDA events, once eager and once as graph replays of
the same call: the span per call includes any time the GPU sat idle waiting for the host.
Arms are bracketed in rounds (megamoe_rt/cli/timing.py). Across launched ranks
(``megamoe-rt launch -n 2 -m megamoe_rt.cli.bench overhead ...``) every rank measures and the
slowest rank is reported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from megamoe_rt.cli.output import write_json
from megamoe_rt.cli.timing import DeviceTimer, bracketed, capture_layer_call

TARGET_US = 40.0  # an eager call may cost at most this much more than its replay


def bench_overhead(
    presets: list[str],
    tokens: list[int],
    *,
    modes: list[str],
    calls: int = 50,
    rounds: int = 3,
    group: Any = None,
    json_path: str | None = None,
) -> list[dict]:
    import cupy as cp

    from megamoe_rt.cli.layer_inputs import preset_slices, rank_inputs
    from megamoe_rt.layer import MegaMoE

    world = 1 if group is None else group.world_size
    rank = 0 if group is None else group.rank
    rows = []
    for name, p, local, experts, t in preset_slices(presets, tokens, world):
        args, weights = rank_inputs(cp, rank, t, p.hidden, p.intermediate, experts, local, p.num_topk, t)
        stream = cp.cuda.Stream(non_blocking=True)
        for m in modes:
            layer = MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, t, mode=m, group=group)
            layer.load_weights(*weights)
            y = cp.empty((t, p.hidden), dtype=cp.uint16)
            graph = capture_layer_call(layer, args, y, stream)
            host_s: list[float] = []

            def eager(layer=layer, args=args, y=y, stream=stream, host_s=host_s) -> None:
                start = time.perf_counter()
                for _ in range(calls):
                    layer(*args, out=y, stream=stream)
                host_s.append(time.perf_counter() - start)

            def replay(graph=graph, stream=stream) -> None:
                for _ in range(calls):
                    graph.launch(stream=stream)

            arms: dict[str, Callable[[], None]] = {"eager": eager, "replay": replay}
            with stream:
                results = bracketed(DeviceTimer(calls=5), arms, rounds=rounds)
            layer.synchronize()  # nothing was refused: this raises otherwise
            mine = {a: results[a].median_us / calls for a in arms}
            mine["host"] = sorted(host_s)[len(host_s) // 2] / calls * 1e6
            everyone = [mine]
            if group is not None:
                everyone = [json.loads(raw) for raw in group.allgather(json.dumps(mine).encode(), key="overhead")]
            eager_us = max(e["eager"] for e in everyone)
            replay_us = max(e["replay"] for e in everyone)
            row = {
                "preset": name,
                "tokens_per_rank": t,
                "ranks": world,
                "mode": m,
                "calls_per_observation": calls,
                "eager_us_per_call": eager_us,
                "replay_us_per_call": replay_us,
                "overhead_us": eager_us - replay_us,
                "host_us_per_eager_call": max(e["host"] for e in everyone),
                "target_us": TARGET_US,
                "meets_target": eager_us - replay_us <= TARGET_US,
            }
            rows.append(row)
            if rank == 0:
                print(
                    f"{name:>5} T={t:<5} EP{world} {m:>8}: eager {eager_us:8.1f} us/call  replay "
                    f"{replay_us:8.1f} us/call  overhead {row['overhead_us']:+7.1f} us (target <= {TARGET_US:.0f})"
                    f"  host {row['host_us_per_eager_call']:6.1f} us/call",
                    flush=True,
                )
            if group is not None:
                group.barrier()
            layer.close()
            del graph, arms
        cp.get_default_memory_pool().free_all_blocks()
    if json_path and rank == 0:
        write_json(json_path, rows)
    return rows
