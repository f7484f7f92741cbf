"""Cross-rank kernels of the unfused layer under expert parallelism (cuda_src/ep/): specs,
parameter struct and launches."""

from __future__ import annotations

from typing import Any

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.interface import ep as decl
from megamoe_rt.kernels.interface.structs import EpBankLayout as EpBankLayout
from megamoe_rt.kernels.interface.structs import EpParams as EpParams
from megamoe_rt.runtime.launches import Launches
from megamoe_rt.schedule.arith import ceil_div

SOURCE = "ep/ep_unfused.cu"
THREADS = decl.THREADS.value
SCAN_THREADS = decl.SCAN_THREADS.value
MAX_EXPERTS = decl.MAX_EXPERTS.value
MAX_RANKS = decl.MAX_RANKS.value
_IDX_CXX = {"int32": "megamoe_rt::i32", "int64": "megamoe_rt::i64"}


def bank_layout(num_ranks: int, num_local_experts: int) -> EpBankLayout:
    """Word offsets of one bank: recv_counts | recv_offsets | count_ready | combine_ready | pool_cycles."""
    n = num_ranks * num_local_experts
    bank = EpBankLayout(
        words=decl.bank_words(num_ranks, num_local_experts),
        recv_counts=0,
        recv_offsets=n,
        count_ready=2 * n,
        combine_ready=2 * n + num_ranks,
        pool_cycles=2 * n + 2 * num_ranks,
    )
    assert bank.pool_cycles + 1 == bank.words, "the regions fill the bank the buffer layout reserves"
    return bank


def _spec(entry: str, idx: str | None, threads: int) -> KernelSpec:
    name = f"ep_{entry}" + (f"[{idx}]" if idx else "")
    expr = f"megamoe_rt::ep::ep_{entry}" + (f"<{_IDX_CXX[idx]}>" if idx else "")
    # The waits on peers print their report (these kernels have no wgmma).
    return KernelSpec(name=name, source=SOURCE, entry=expr, block_threads=threads, uses_printf=True, params=(EpParams,))


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


def launch_routing(kernels: dict[str, Any], params: EpParams, *, pairs: int, sm_count: int, q: Launches) -> None:
    """Everything up to the pool being laid out: parity, send list, publish, receive."""
    one = [params]
    grid_pairs = max(1, min(ceil_div(pairs, THREADS), sm_count * 4))
    q.kernel(kernels["begin"], (1,), (THREADS,), one)
    q.kernel(kernels["count"], (grid_pairs,), (THREADS,), one)
    q.kernel(kernels["send_scan"], (1,), (SCAN_THREADS,), one)
    q.kernel(kernels["claim"], (grid_pairs,), (THREADS,), one)
    q.kernel(kernels["publish"], (1,), (THREADS,), one)
    q.kernel(kernels["recv_layout"], (1,), (SCAN_THREADS,), one)


def launch_pull(kernels: dict[str, Any], params: EpParams, *, sm_count: int, q: Launches) -> None:
    """Pull the pool rows of the window at ``params.moe.row_base`` (the whole pool without a ring)."""
    grid_rows = max(1, min(ceil_div(params.moe.pool_rows, THREADS // 32), sm_count * 16))
    q.kernel(kernels["dispatch"], (grid_rows,), (THREADS,), [params])


def launch_finish(kernels: dict[str, Any], params: EpParams, q: Launches) -> None:
    q.kernel(kernels["finish"], (1,), (THREADS,), [params])
