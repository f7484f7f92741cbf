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
    """Word offsets of one bank: recv_counts | recv_offsets | count_ready | combine_ready | pool_cycles
    (computed from the declaration, :func:`megamoe_rt.kernels.interface.ep.bank_offsets`)."""
    return EpBankLayout(**decl.bank_offsets(num_ranks, num_local_experts))


# Transports of the cross-rank kernels (cuda_src/ep/transport.cuh): the C++ policy type, and
# what a variant built for it adds to its spec.
TRANSPORTS = ("nvlink", "nvshmem")
_TRANSPORT_CXX = {"nvlink": "megamoe_rt::ep::PeerPointers", "nvshmem": "megamoe_rt::ep::NvshmemApi"}
# The kernels that reach other ranks, and so take the transport as a template argument.
_CROSS_RANK = ("publish", "recv_layout", "dispatch", "finish")


def _spec(entry: str, idx: str | None, threads: int, transport: str = "nvlink") -> KernelSpec:
    cross = entry in _CROSS_RANK or entry == "push"
    name = f"ep_{entry}" + (f"[{idx}]" if idx else "") + (f"[{transport}]" if cross and transport != "nvlink" else "")
    args = [
        a for a in (_IDX_CXX[idx] if idx else None, _TRANSPORT_CXX[transport] if entry in _CROSS_RANK else None) if a
    ]
    expr = f"megamoe_rt::ep::ep_{entry}" + (f"<{', '.join(args)}>" if args else "")
    extra: dict[str, Any] = {}
    if cross and transport == "nvshmem":
        # NVSHMEM's device API, linked from its device library (megamoe_rt/jit/link.py).
        extra = {
            "defines": (("MEGAMOE_RT_NVSHMEM_TRANSPORT", "1"),),
            "needs": ("cuda", "cccl"),
            "device_libraries": ("nvshmem",),
        }
    # The waits on peers print their report (these kernels have no wgmma).
    return KernelSpec(
        name=name, source=SOURCE, entry=expr, block_threads=threads, uses_printf=True, params=(EpParams,), **extra
    )


def specs(idx: str, transport: str = "nvlink") -> dict[str, KernelSpec]:
    """The unfused layer's cross-rank kernels for routing ids of type ``idx``, those that reach
    other ranks built for ``transport`` (TRANSPORTS); "push" only with NVSHMEM."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: expected one of {TRANSPORTS}")
    out = {
        "begin": _spec("begin", None, THREADS),
        "count": _spec("count", idx, THREADS),
        "send_scan": _spec("send_scan", None, SCAN_THREADS),
        "claim": _spec("claim", idx, THREADS),
        "publish": _spec("publish", None, THREADS, transport),
        "recv_layout": _spec("recv_layout", None, SCAN_THREADS, transport),
        "dispatch": _spec("dispatch", None, THREADS, transport),
        "finish": _spec("finish", None, THREADS, transport),
    }
    if transport == "nvshmem":
        out["push"] = _spec("push", None, THREADS, transport)
    return out


def kernel_specs() -> list[KernelSpec]:
    """The peer-pointer variants (compiled with every other kernel)."""
    out: dict[str, KernelSpec] = {}
    for idx in ("int32", "int64"):
        for s in specs(idx).values():
            out[s.name] = s
    return list(out.values())


def device_link_specs() -> list[KernelSpec]:
    """The NVSHMEM-transport variants of the cross-rank kernels: they link NVSHMEM's device
    library (compiled and linked by tests/cpu/test_device_link.py)."""
    out: dict[str, KernelSpec] = {}
    for s in specs("int32", "nvshmem").values():
        if s.device_libraries:
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


def launch_push(kernels: dict[str, Any], params: EpParams, *, sm_count: int, q: Launches) -> None:
    """NVSHMEM transport: put the staged partials of the window at ``params.moe.row_base`` to
    their source ranks (after the window's L2 GEMM, before the next window reuses the staging)."""
    grid_rows = max(1, min(ceil_div(params.moe.pool_rows, THREADS // 32), sm_count * 16))
    q.kernel(kernels["push"], (grid_rows,), (THREADS,), [params])
