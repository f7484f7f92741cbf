"""The fused MoE kernel (cuda_src/fused/): variants, parameter struct, shared-memory sizing.

One cooperative launch runs routing, dispatch, both GEMMs on the lag-ordered stream and the
combine. Everything the kernel indexes by (ring, counters, tables) is sized here from the
buffer layout and reaches it through :class:`FusedParams`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from megamoe_rt.runtime.deadlines import WaitContext
from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.ep import EpBankLayout
from megamoe_rt.kernels.gemm import SMEM_LIMIT, GemmConfig, GemmParams
from megamoe_rt.kernels.moe import MoeParams

SOURCE = "fused/sm90_fp8_fused_moe.cu"
BLOCK_M = 64
BLOCK_N = 256
NUM_THREADS = 384
MIN_STAGES = 3
MAX_STAGES = 6
NO_BLOCK = 0xFFFFFFFF
MAX_BLOCKS = 0xFFFF  # unit table entries are 16-bit block numbers
_IDX_CXX = {"int32": "megamoe_rt::i32", "int64": "megamoe_rt::i64"}
_ALIGN_SLACK = 1024


class BankLayout(ctypes.Structure):
    """Mirror of ``megamoe_rt::fused::BankLayout`` (fused/params.cuh)."""

    _fields_ = [("words", ctypes.c_uint32), ("counts", ctypes.c_uint32), ("cursors", ctypes.c_uint32),
                ("arrivals", ctypes.c_uint32), ("l1_done", ctypes.c_uint32), ("l2_read", ctypes.c_uint32),
                ("ticket", ctypes.c_uint32)]


def bank_layout(num_experts: int, max_blocks: int) -> BankLayout:
    """``num_experts``: the experts this rank counts its pairs for: its own on one rank, all
    (global) across ranks, where the counts and cursors lay out its send list."""
    el, b = num_experts, max_blocks
    return BankLayout(words=bank_words(el, b), counts=0, cursors=el, arrivals=2 * el, l1_done=2 * el + b,
                      l2_read=2 * el + 2 * b, ticket=2 * el + 3 * b)


def bank_words(num_local_experts: int, max_blocks: int) -> int:
    """u32 words of one launch-parity bank (the layout's ``fused_banks`` rows)."""
    return 2 * num_local_experts + 3 * max_blocks + 1


class FusedParams(ctypes.Structure):
    """Mirror of ``megamoe_rt::fused::FusedParams`` (fused/params.cuh)."""

    _fields_ = [
        ("moe", MoeParams),
        ("l1", GemmParams),
        ("l2", GemmParams),
        ("wait", WaitContext),
        ("banks", ctypes.c_uint64 * 2),
        ("bank", BankLayout),
        ("launch_epoch", ctypes.c_uint64),
        ("grid_barrier", ctypes.c_uint64),
        ("ring_blocks", ctypes.c_uint32),
        ("max_blocks", ctypes.c_uint32),
        ("lag_units", ctypes.c_uint32),
        ("group_units", ctypes.c_uint32),
        ("table_smem_offset", ctypes.c_uint32),
        ("withhold_block", ctypes.c_uint32),
        ("trace", ctypes.c_uint64),
        # across ranks
        ("peer_bases", ctypes.c_uint64),
        ("off_x", ctypes.c_uint64),
        ("off_x_sf", ctypes.c_uint64),
        ("off_send_list", ctypes.c_uint64),
        ("off_combine", ctypes.c_uint64),
        ("off_ep_banks", ctypes.c_uint64),
        ("send_list", ctypes.c_uint64),
        ("ep_banks", ctypes.c_uint64),
        ("ep_bank", EpBankLayout),
        ("rank", ctypes.c_uint32),
        ("num_ranks", ctypes.c_uint32),
    ]


# fused/params.cuh TraceEvent, in order.
TRACE_EVENTS = ("start", "counted", "claimed", "dispatch_done", "producer_done", "math_done", "all_tiles_done",
                "combine_done")


RELAY_BYTES = 320       # fused/signal_relay.cuh SignalRelay::kBytes
TILE_QUEUE_BYTES = 80  # fused/tile_queue.cuh TileQueue::kBytes


def table_bytes(num_local_experts: int, max_blocks: int) -> int:
    """Shared memory after the GEMM stages (fused RoutingTables::bytes): the tile queue, the
    routing tables and the signal relay's queue."""
    return TILE_QUEUE_BYTES + RELAY_BYTES + 4 * (2 * num_local_experts + 1) + 16 + 4 * max_blocks


def tile_smem_bytes(stages: int) -> int:
    """The GEMM carve-up (stages, epilogue scratch, barriers) before the tables: config.cuh kSmemBytes."""
    return stages * GemmConfig.stage_bytes(BLOCK_M, BLOCK_N, 64) + 2 * 64 * 4 + 2 * stages * 8


def ep_scratch_bytes(num_experts: int, num_local_experts: int, num_ranks: int) -> int:
    """Across ranks, after the tables (fused/expert_parallel.cuh EpScratch): send offsets,
    per-expert totals and per-(expert, source) first rows."""
    if num_ranks == 1:
        return 0
    return 4 * (num_experts + 1 + num_local_experts + num_local_experts * (num_ranks + 1))


def dynamic_smem_bytes(stages: int, num_local_experts: int, max_blocks: int, extra: int = 0) -> int:
    return tile_smem_bytes(stages) + table_bytes(num_local_experts, max_blocks) + extra + _ALIGN_SLACK


def pick_stages(num_local_experts: int, max_blocks: int, extra: int = 0) -> int:
    """The deepest pipeline whose stages and routing tables (plus ``extra`` bytes) fit in shared memory."""
    for s in range(MAX_STAGES, MIN_STAGES - 1, -1):
        if dynamic_smem_bytes(s, num_local_experts, max_blocks, extra) <= SMEM_LIMIT:
            return s
    raise ValueError(f"{num_local_experts} local experts and {max_blocks} pool blocks leave no room for "
                     f"{MIN_STAGES} pipeline stages in shared memory")


@dataclass(frozen=True)
class FusedConfig:
    stages: int
    act_sf_gran: int
    idx: str = "int32"
    expert_parallel: bool = False   # the instantiation that runs across ranks
    smem_bytes: int = 0   # dynamic shared memory of a launch (tables depend on the buffer)

    @property
    def name(self) -> str:
        ep = ",ep" if self.expert_parallel else ""
        return f"fused_moe[s{self.stages},asf{self.act_sf_gran},{self.idx}{ep}]"

    def spec(self) -> KernelSpec:
        entry = (f"megamoe_rt::fused::sm90_fp8_fused_moe<{self.stages}u, {self.act_sf_gran}u, "
                 f"{_IDX_CXX[self.idx]}, {'true' if self.expert_parallel else 'false'}>")
        return KernelSpec(name=self.name, source=SOURCE, entry=entry,
                          dynamic_smem_bytes=self.smem_bytes or SMEM_LIMIT,
                          block_threads=NUM_THREADS, expect_sass=("QGMMA",))


def kernel_specs() -> list[KernelSpec]:
    """The variants buffers of the shipped presets pick (deeper pipelines for smaller tables)."""
    return [FusedConfig(s, g, idx, ep).spec() for s in (4, 5) for g in (64, 128) for idx in ("int32", "int64")
            for ep in (False, True)]
