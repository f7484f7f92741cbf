"""Cross-rank kernels of the unfused layer under expert parallelism (cuda_src/ep/): specs,
parameter struct and launches."""

from __future__ import annotations

import ctypes
from typing import Any

from megamoe_rt.runtime.deadlines import WaitContext
from megamoe_rt.jit import KernelSpec
from megamoe_rt.schedule.arith import ceil_div
from megamoe_rt.schedule.layout import ep_bank_words
from megamoe_rt.kernels.moe import MoeParams

SOURCE = "ep/ep_unfused.cu"
THREADS = 256
SCAN_THREADS = 1024
MAX_EXPERTS = 1024
_IDX_CXX = {"int32": "megamoe_rt::i32", "int64": "megamoe_rt::i64"}


class EpBankLayout(ctypes.Structure):
    """Mirror of ``megamoe_rt::ep::EpBankLayout`` (ep/params.cuh)."""

    _fields_ = [("words", ctypes.c_uint32), ("recv_counts", ctypes.c_uint32), ("recv_offsets", ctypes.c_uint32),
                ("count_ready", ctypes.c_uint32), ("combine_ready", ctypes.c_uint32), ("pad_", ctypes.c_uint32)]


def bank_layout(num_ranks: int, num_local_experts: int) -> EpBankLayout:
    n = num_ranks * num_local_experts
    return EpBankLayout(words=ep_bank_words(num_ranks, num_local_experts), recv_counts=0, recv_offsets=n,
                        count_ready=2 * n, combine_ready=2 * n + num_ranks)


class EpParams(ctypes.Structure):
    """Mirror of ``megamoe_rt::ep::EpParams`` (ep/params.cuh)."""

    _fields_ = [
        ("moe", MoeParams),
        ("peer_bases", ctypes.c_uint64),
        ("off_x", ctypes.c_uint64),
        ("off_x_sf", ctypes.c_uint64),
        ("off_send_list", ctypes.c_uint64),
        ("off_combine", ctypes.c_uint64),
        ("off_banks", ctypes.c_uint64),
        ("send_counts", ctypes.c_uint64),
        ("send_offsets", ctypes.c_uint64),
        ("send_cursors", ctypes.c_uint64),
        ("send_list", ctypes.c_uint64),
        ("src_rows", ctypes.c_uint64),
        ("banks", ctypes.c_uint64),
        ("bank", EpBankLayout),
        ("launch_epoch", ctypes.c_uint64),
        ("wait", WaitContext),
        ("rank", ctypes.c_uint32),
        ("num_ranks", ctypes.c_uint32),
    ]


def _spec(entry: str, idx: str | None, threads: int) -> KernelSpec:
    name = f"ep_{entry}" + (f"[{idx}]" if idx else "")
    expr = f"megamoe_rt::ep::ep_{entry}" + (f"<{_IDX_CXX[idx]}>" if idx else "")
    # The waits on peers print their report (these kernels have no wgmma).
    return KernelSpec(name=name, source=SOURCE, entry=expr, block_threads=threads, uses_printf=True)


def specs(idx: str) -> dict[str, KernelSpec]:
    return {
        "begin": _spec("begin", None, THREADS),
        "count": _spec("count", idx, THREADS),
        "send_scan": _spec("send_scan", None, SCAN_THREADS),
        "claim": _spec("claim", idx, THREADS),
        "publish": _spec("publish", None, THREADS),
        "recv_layout": _spec("recv_layout", None, SCAN_THREADS),
        "dispatch": _spec("dispatch", None, THREADS),
        "finish": _spec("finish", None, THREADS),
    }


def kernel_specs() -> list[KernelSpec]:
    out: dict[str, KernelSpec] = {}
    for idx in ("int32", "int64"):
        for s in specs(idx).values():
            out[s.name] = s
    return list(out.values())


def launch_before_gemms(kernels: dict[str, Any], params: EpParams, *, pairs: int, pool_rows: int, sm_count: int,
                        stream: int) -> None:
    """Everything up to the pool being filled: parity, send list, publish, receive, pull."""
    one = [params]
    grid_pairs = max(1, min(ceil_div(pairs, THREADS), sm_count * 4))
    kernels["begin"].launch((1,), (THREADS,), one, stream=stream)
    kernels["count"].launch((grid_pairs,), (THREADS,), one, stream=stream)
    kernels["send_scan"].launch((1,), (SCAN_THREADS,), one, stream=stream)
    kernels["claim"].launch((grid_pairs,), (THREADS,), one, stream=stream)
    kernels["publish"].launch((1,), (THREADS,), one, stream=stream)
    kernels["recv_layout"].launch((1,), (SCAN_THREADS,), one, stream=stream)
    grid_rows = max(1, min(ceil_div(pool_rows, THREADS // 32), sm_count * 16))
    kernels["dispatch"].launch((grid_rows,), (THREADS,), one, stream=stream)


def launch_finish(kernels: dict[str, Any], params: EpParams, stream: int) -> None:
    kernels["finish"].launch((1,), (THREADS,), [params], stream=stream)
