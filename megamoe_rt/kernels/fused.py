"""The fused MoE kernel (cuda_src/fused/): variants, parameter struct, shared-memory sizing.

One cooperative launch runs routing, dispatch, both GEMMs in the lag task order and the
combine. Everything the kernel indexes by (ring, counters, tables) is sized here from the
buffer layout and reaches it through :class:`FusedParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.interface import fused as decl
from megamoe_rt.kernels.interface import gemm as gemm_decl
from megamoe_rt.kernels.interface.decl import TMA_DESCRIPTOR
from megamoe_rt.kernels.interface.structs import BankLayout as BankLayout
from megamoe_rt.kernels.interface.structs import FusedParams as FusedParams

SOURCE = "fused/sm90_fp8_fused_moe.cu"
REDUCE_SOURCE = "split/split_reduce.cu"
REDUCE_THREADS = decl.REDUCE_THREADS.value
# Roles of a launch (Role in interface/fused.cuh): the whole layer, or one side of the split pipeline.
ROLES = tuple(v.key for v in decl.ROLE.values)
_ROLE_CXX = {v.key: f"megamoe_rt::fused::Role::{v.cxx}" for v in decl.ROLE.values}
BLOCK_M = decl.BLOCK_M.value
BLOCK_N = decl.BLOCK_N.value
NUM_THREADS = decl.NUM_THREADS.value
MIN_STAGES = 3
MAX_STAGES = 6
NO_BLOCK = decl.NO_BLOCK.value
MAX_BLOCKS = decl.MAX_BLOCKS.value  # a call's pool rows stay within an i32
SMEM_LIMIT = gemm_decl.SMEM_LIMIT.value
_IDX_CXX = {"int32": "megamoe_rt::i32", "int64": "megamoe_rt::i64"}


# The optional per-block trace's events, in TraceEvent order.
TRACE_EVENTS = tuple(v.key for v in decl.TRACE_EVENT.values)
# The columns that are %globaltimer stamps; after them "sm", the block's SM, then the
# nanoseconds the block's warps spent in each kind of data wait (fused/trace.cuh, TracedWait).
TRACE_TIMES = TRACE_EVENTS[: TRACE_EVENTS.index("sm")]
TRACE_WAITS = TRACE_EVENTS[TRACE_EVENTS.index("sm") + 1 :]

RELAY_BYTES = decl.RELAY_BYTES.value  # SignalRelay::kBytes (asserted there)
TILE_QUEUE_BYTES = decl.TILE_QUEUE_BYTES.value  # TileQueue::kBytes (asserted there)
# A streamed call hands tiles over as one word with a 6-bit n-block (StreamTileWord in
# fused/streamed_call.cuh): both layers' N at most this many tiles.
STREAMED_MAX_N_BLOCKS = 64


def bank_layout(num_experts: int, max_blocks: int) -> BankLayout:
    """``num_experts``: the experts this rank counts its pairs for: its own on one rank, all
    (global) across ranks, where the counts and cursors lay out its send list."""
    return BankLayout(**decl.bank_offsets(num_experts, max_blocks))


def bank_words(num_local_experts: int, max_blocks: int) -> int:
    """u32 words of one launch-parity bank (the layout's ``fused_banks`` rows)."""
    return int(decl.bank_words(num_local_experts, max_blocks))


def table_bytes(num_local_experts: int) -> int:
    """Shared memory after the GEMM stages (RoutingTables): the tile queue, the routing tables
    and the signal relay's queue; sized by the local experts, whatever the pool."""
    return int(decl.routing_table_bytes(num_local_experts))


def tile_smem_bytes(stages: int) -> int:
    """The GEMM carve-up (stages, epilogue scratch, barriers) before the tables."""
    return int(decl.tile_smem_bytes(stages))


def ep_scratch_bytes(num_experts: int, num_local_experts: int, num_ranks: int) -> int:
    """Across ranks, after the tables (EpScratch): send offsets, per-expert totals and
    per-(expert, source) first rows; none on one rank."""
    if num_ranks == 1:
        return 0
    return int(decl.ep_scratch_bytes(num_experts, num_local_experts, num_ranks))


def dynamic_smem_bytes(stages: int, num_local_experts: int, extra: int = 0) -> int:
    slack = gemm_decl.SMEM_ALIGN_SLACK.value
    return tile_smem_bytes(stages) + table_bytes(num_local_experts) + extra + slack


def pick_stages(num_local_experts: int, extra: int = 0) -> int:
    """The deepest pipeline whose stages and routing tables (plus ``extra`` bytes) fit in shared memory."""
    for s in range(MAX_STAGES, MIN_STAGES - 1, -1):
        if dynamic_smem_bytes(s, num_local_experts, extra) <= SMEM_LIMIT:
            return s
    raise ValueError(
        f"{num_local_experts} local experts leave no room for {MIN_STAGES} pipeline stages in shared memory"
    )


@dataclass(frozen=True)
class FusedConfig:
    stages: int
    act_sf_gran: int
    idx: str = "int32"
    expert_parallel: bool = False  # the instantiation that runs across ranks
    smem_bytes: int = 0  # dynamic shared memory of a launch (tables depend on the buffer)
    role: str = "fused"  # one of ROLES

    @property
    def name(self) -> str:
        ep = ",ep" if self.expert_parallel else ""
        role = "" if self.role == "fused" else f",{self.role}"
        return f"fused_moe[s{self.stages},asf{self.act_sf_gran},{self.idx}{ep}{role}]"

    def spec(self) -> KernelSpec:
        entry = (
            f"megamoe_rt::fused::sm90_fp8_fused_moe<{self.stages}u, {self.act_sf_gran}u, "
            f"{_IDX_CXX[self.idx]}, {'true' if self.expert_parallel else 'false'}, {_ROLE_CXX[self.role]}>"
        )
        return KernelSpec(
            name=self.name,
            source=SOURCE,
            entry=entry,
            dynamic_smem_bytes=self.smem_bytes or SMEM_LIMIT,
            block_threads=NUM_THREADS,
            expect_sass=("QGMMA",),
            params=(FusedParams,) + (TMA_DESCRIPTOR,) * 6,
        )


def reduce_spec(idx: str, expert_parallel: bool) -> KernelSpec:
    """The split pipeline's K3: the top-k reduce (after K1 and K2; across ranks it first waits
    for every rank's partials)."""
    ep = ",ep" if expert_parallel else ""
    return KernelSpec(
        name=f"split_reduce[{idx}{ep}]",
        source=REDUCE_SOURCE,
        entry=f"megamoe_rt::split::split_reduce<{_IDX_CXX[idx]}, {'true' if expert_parallel else 'false'}>",
        block_threads=REDUCE_THREADS,
        params=(FusedParams,),
    )


def kernel_specs() -> list[KernelSpec]:
    """The variants buffers of the shipped presets pick (deeper pipelines for smaller tables),
    in every role (a streamed call: one rank, the ring's int32 ids), and the split pipeline's
    reduce."""
    batch = [role for role in ROLES if role != "streamed"]
    return (
        [
            FusedConfig(s, g, idx, ep, role=role).spec()
            for role in batch
            for s in (4, 5)
            for g in (64, 128)
            for idx in ("int32", "int64")
            for ep in (False, True)
        ]
        + [FusedConfig(s, g, "int32", False, role="streamed").spec() for s in (4, 5) for g in (64, 128)]
        + [reduce_spec(idx, ep) for idx in ("int32", "int64") for ep in (False, True)]
    )
