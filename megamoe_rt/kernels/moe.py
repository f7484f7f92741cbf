"""Routing, dispatch and combine kernels of the unfused MoE path: specs, params, launches."""

from __future__ import annotations

import dataclasses
from typing import Any

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.interface import moe as decl
from megamoe_rt.kernels.interface.structs import MoeParams as MoeParams
from megamoe_rt.kernels.interface.structs import StreamConsumeParams as StreamConsumeParams
from megamoe_rt.kernels.interface.structs import StreamPoolParams as StreamPoolParams
from megamoe_rt.runtime.launches import Launches
from megamoe_rt.schedule.arith import ceil_div

COUNT_THREADS = decl.COUNT_THREADS.value
SCAN_THREADS = decl.SCAN_THREADS.value
DISPATCH_THREADS = decl.DISPATCH_THREADS.value
COMBINE_THREADS = decl.COMBINE_THREADS.value
MAX_LOCAL_EXPERTS = decl.MAX_LOCAL_EXPERTS.value
MAX_TOPK = decl.MAX_TOPK.value


_IDX_CXX = {"int32": "megamoe_rt::i32", "int64": "megamoe_rt::i64"}


def _spec(kind: str, source: str, entry: str, idx: str | None, threads: int) -> KernelSpec:
    name = f"moe_{kind}" + (f"[{idx}]" if idx else "")
    expr = f"megamoe_rt::moe::{entry}" + (f"<{_IDX_CXX[idx]}>" if idx else "")
    return KernelSpec(name=name, source=source, entry=expr, block_threads=threads, params=(MoeParams,))


def count_spec(idx: str) -> KernelSpec:
    return _spec("count_routes", "moe/route.cu", "moe_count_routes", idx, COUNT_THREADS)


def offsets_spec() -> KernelSpec:
    return _spec("pool_offsets", "moe/route.cu", "moe_pool_offsets", None, SCAN_THREADS)


def dispatch_spec(idx: str) -> KernelSpec:
    return _spec("dispatch", "moe/dispatch.cu", "moe_dispatch", idx, DISPATCH_THREADS)


def fill_window_spec() -> KernelSpec:
    return _spec("fill_window", "moe/dispatch.cu", "moe_fill_window", None, DISPATCH_THREADS)


def combine_spec(idx: str) -> KernelSpec:
    return _spec("combine", "moe/combine.cu", "moe_combine", idx, COMBINE_THREADS)


def stream_consume_spec() -> KernelSpec:
    """Every chunk of a streamed call in one launch (waits print their report)."""
    spec = _spec("stream_consume", "moe/stream_pool.cu", "moe_stream_consume", None, DISPATCH_THREADS)
    return dataclasses.replace(spec, uses_printf=True, params=(StreamConsumeParams,))


def stream_seal_spec() -> KernelSpec:
    spec = _spec("stream_seal", "moe/stream_pool.cu", "moe_stream_seal", None, SCAN_THREADS)
    return dataclasses.replace(spec, params=(StreamPoolParams,))


def kernel_specs() -> list[KernelSpec]:
    out = [offsets_spec(), fill_window_spec(), stream_consume_spec(), stream_seal_spec()]
    for idx in ("int32", "int64"):
        out += [count_spec(idx), dispatch_spec(idx), combine_spec(idx)]
    return out


def grids(num_tokens: int, num_topk: int, sm_count: int) -> dict[str, int]:
    pairs = num_tokens * num_topk
    return {
        "count": max(1, min(ceil_div(pairs, COUNT_THREADS), sm_count * 4)),
        "dispatch": max(1, min(ceil_div(pairs, DISPATCH_THREADS // 32), sm_count * 16)),
        "combine": max(1, min(num_tokens, sm_count * 16)),
    }


def launch_route_dispatch(kernels: dict[str, Any], params: MoeParams, grid: dict[str, int], q: Launches) -> None:
    q.kernel(kernels["count"], (grid["count"],), (COUNT_THREADS,), [params])
    q.kernel(kernels["offsets"], (1,), (SCAN_THREADS,), [params])
    q.kernel(kernels["dispatch"], (grid["dispatch"],), (DISPATCH_THREADS,), [params])


def launch_fill_window(kernel: Any, params: MoeParams, sm_count: int, q: Launches) -> None:
    """Copy the pool rows of the window at ``params.row_base`` into the ring (one rank)."""
    warps = DISPATCH_THREADS // 32
    grid = max(1, min(ceil_div(params.pool_rows, warps), sm_count * 16))
    q.kernel(kernel, (grid,), (DISPATCH_THREADS,), [params])


def launch_combine(kernels: dict[str, Any], params: MoeParams, grid: dict[str, int], q: Launches) -> None:
    q.kernel(kernels["combine"], (grid["combine"],), (COMBINE_THREADS,), [params])
