"""Grouped FP8 GEMM: kernel variants, parameter struct, TMA descriptors and launch.

Shapes, strides and tensor maps are computed on the host (the operands' in
:mod:`megamoe_rt.kernels.operands`) and reach the kernel as :class:`GemmParams`, the
epilogue's own parameter struct and three ``__grid_constant__`` tensor maps; the device code holds no layout arithmetic of its own
beyond its tile. Epilogues are registered in :mod:`megamoe_rt.kernels.epilogues`.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from typing import Any

from megamoe_rt.jit import KernelSpec
from megamoe_rt.kernels.epilogues import EPILOGUES, get_epilogue
from megamoe_rt.kernels.interface import gemm as decl
from megamoe_rt.kernels.interface.decl import TMA_DESCRIPTOR
from megamoe_rt.kernels.interface.structs import GemmParams as GemmParams
from megamoe_rt.kernels.interface.structs import ScatterBf16Params as ScatterBf16Params
from megamoe_rt.kernels.interface.structs import StoreBf16Params as StoreBf16Params
from megamoe_rt.kernels.interface.structs import SwigluFp8Params as SwigluFp8Params
from megamoe_rt.kernels.interface.structs import WaitContext as WaitContext
from megamoe_rt.kernels.operands import BLOCK_K as BLOCK_K
from megamoe_rt.kernels.operands import Fp8Operand
from megamoe_rt.runtime.launches import Launches
from megamoe_rt.runtime.tma import TensorMap2D

SOURCE = "gemm/sm90_fp8_grouped_gemm.cu"
SMEM_LIMIT = decl.SMEM_LIMIT.value  # 227 KiB opt-in per block on sm_90
MAX_STAGES = 8

LAYOUTS = decl.GROUP_LAYOUT.keys()  # {"contiguous": 0, "masked": 1}

FLAG_CLAMP = decl.FLAGS["clamp"]
FLAG_POW2_SCALE = decl.FLAGS["pow2_scale"]


@dataclass(frozen=True)
class GemmConfig:
    """One kernel instantiation. Mirrors ``megamoe_rt::gemm::Config`` (gemm/config.cuh)."""

    block_m: int
    block_n: int
    stages: int
    a_sf_gran: int = 128  # A scales per 64 or 128 K elements
    b_sf_n: int = 128  # B scales per 64 or 128 output columns
    out_sf_gran: int = 128  # requant group of an epilogue that writes e4m3 (SwiGLU)
    cluster_n: int = 1  # CTAs per cluster along N sharing the A tile (2: 128x128 only, see below)
    layout: str = "contiguous"
    epilogue: str = "bf16"

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128) or self.block_n not in (128, 256):
            raise ValueError(f"tile {self.block_m}x{self.block_n}: BLOCK_M must be 64|128 and BLOCK_N 128|256")
        if self.num_math_warpgroups not in (1, 2):
            raise ValueError(
                f"tile {self.block_m}x{self.block_n} needs {self.num_math_warpgroups} math warpgroups; 1 or 2 supported"
            )
        if self.layout not in LAYOUTS or self.epilogue not in EPILOGUES:
            raise ValueError(f"layout {self.layout!r} / epilogue {self.epilogue!r} unknown")
        problem = EPILOGUES[self.epilogue].problem(**dataclasses.asdict(self))
        if problem:
            raise ValueError(problem)
        pair_ok = (self.block_m, self.block_n, self.epilogue) == (128, 128, "bf16")
        if self.cluster_n not in (1, 2) or (self.cluster_n == 2 and not pair_ok):
            # CTA pairs load half of the shared A tile each and multicast it (bench/NOTES.md). Their
            # waits on the peer are bounded as every pipeline wait is: by the producers' free-stage
            # waits, which count both CTAs' math warps and carry the deadline.
            raise ValueError(
                f"cluster_n={self.cluster_n} with tile {self.block_m}x{self.block_n} ({self.epilogue}): CTA "
                "pairs are built for the 128x128 tile with the bf16 epilogue only; use cluster_n=1 otherwise"
            )
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages={self.stages}: expected 2..{MAX_STAGES}")
        if self.dynamic_smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self.name}: {self.dynamic_smem_bytes} bytes of shared memory exceed {SMEM_LIMIT}")

    @property
    def num_math_warpgroups(self) -> int:
        """Rows split across warpgroups first; columns only where rows are not (``Config::kWgN``)."""
        wg_m = self.block_m // 64
        return wg_m * min(self.block_n // 128, 2 // wg_m)

    @property
    def n_passes(self) -> int:
        """128-column passes each math warpgroup makes per k-block (2 for 128 x 256)."""
        return self.block_n // 128 // (self.num_math_warpgroups // (self.block_m // 64))

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.num_math_warpgroups)

    @staticmethod
    def stage_bytes(block_m: int, block_n: int, a_sf_gran: int) -> int:
        """Shared memory a pipeline stage occupies. Its scale slot always has room for 64-wide
        groups, so L1 and L2 tiles share one carve-up (``a_sf_gran`` does not change it)."""
        return int(decl.stage_bytes(block_m, block_n))

    @staticmethod
    def stage_load_bytes(block_m: int, block_n: int, a_sf_gran: int) -> int:
        """Bytes TMA delivers per stage (the full barrier's transaction count)."""
        return int(decl.stage_tx_bytes(block_m, block_n, a_sf_gran))

    @property
    def dynamic_smem_bytes(self) -> int:
        return int(decl.dynamic_smem_bytes(self.block_m, self.block_n, self.stages))

    @property
    def stage_tx_bytes(self) -> int:
        return self.stage_load_bytes(self.block_m, self.block_n, self.a_sf_gran)

    @property
    def name(self) -> str:
        return (
            f"fp8_gemm[{self.layout},{self.epilogue},{self.block_m}x{self.block_n},c{self.cluster_n},"
            f"s{self.stages},asf{self.a_sf_gran},bsf{self.b_sf_n},osf{self.out_sf_gran}]"
        )

    def spec(self) -> KernelSpec:
        epi = get_epilogue(self.epilogue)
        entry = (
            f"megamoe_rt::gemm::sm90_fp8_grouped_gemm<{self.block_m}u, {self.block_n}u, {self.stages}u, "
            f"{self.a_sf_gran}u, {self.b_sf_n}u, {self.out_sf_gran}u, {self.cluster_n}u, "
            f"{decl.GROUP_LAYOUT.cxx_of(self.layout)}, {epi.cxx_type}>"
        )
        return KernelSpec(
            name=self.name,
            source=SOURCE,
            entry=entry,
            dynamic_smem_bytes=self.dynamic_smem_bytes,
            block_threads=self.num_threads,
            expect_sass=("QGMMA",),
            includes=(epi.header,),
            params=(GemmParams, epi.params) + (TMA_DESCRIPTOR,) * 3,
        )


def max_stages(block_m: int, block_n: int) -> int:
    s = MAX_STAGES
    while s > 2 and int(decl.dynamic_smem_bytes(block_m, block_n, s)) > SMEM_LIMIT:
        s -= 1
    return s


@dataclass
class GemmLaunch:
    """Everything one launch needs, resolved to pointers and sizes."""

    config: GemmConfig
    a: Fp8Operand  # rows [num_rows, k] with k-major row scales
    b: Fp8Operand  # [groups, n, k] with block scales (params.sfb)
    params: GemmParams
    epilogue_params: ctypes.Structure  # the config's epilogue's Params (where a finished tile goes)

    def tensor_maps(self) -> tuple[TensorMap2D, TensorMap2D, TensorMap2D]:
        cfg = self.config
        # With a CTA pair each CTA loads (and multicasts) half of the A tile.
        return (
            self.a.tensor_map(cfg.block_m // cfg.cluster_n),
            self.b.tensor_map(cfg.block_n),
            self.a.scale_tensor_map(cfg.block_m),
        )


def num_tiles(cfg: GemmConfig, p: GemmParams) -> int:
    """Scheduler units: an m-block with `cluster_n` neighbouring n-blocks."""
    n_blocks = p.n // (cfg.block_n * cfg.cluster_n)
    if cfg.layout == "contiguous":
        return -(-p.num_rows // cfg.block_m) * n_blocks
    return p.num_groups * -(-p.masked_rows // cfg.block_m) * n_blocks


@dataclass
class PreparedGemm:
    """A launch with everything resolved: re-running it costs one driver call."""

    kernel: Any
    grid: int
    block: int
    cluster: tuple[int, int, int]
    args: list[Any]  # params, the epilogue's params and tensor maps (ctypes), kept alive with the plan

    def run(self, stream: Any = None) -> None:
        if self.grid:
            self.kernel.launch((self.grid,), (self.block,), self.args, stream=stream, cluster=self.cluster)

    def enqueue(self, launches: Launches) -> None:
        """The launch into ``launches`` (a stream, or a graph being recorded or replayed)."""
        if self.grid:
            launches.kernel(self.kernel, (self.grid,), (self.block,), self.args, cluster=self.cluster)


def prepare_gemm(launch: GemmLaunch, *, device: int, sm_count: int) -> PreparedGemm:
    from megamoe_rt.kernels.loader import get_kernel

    cfg = launch.config
    if not isinstance(launch.epilogue_params, get_epilogue(cfg.epilogue).params):
        raise TypeError(
            f"{cfg.name}: epilogue parameters {type(launch.epilogue_params).__name__}, expected "
            f"{get_epilogue(cfg.epilogue).params.__name__}"
        )
    if launch.params.n % (cfg.block_n * cfg.cluster_n):
        raise ValueError(f"{cfg.name}: N = {launch.params.n} is not a multiple of {cfg.block_n * cfg.cluster_n}")
    tiles = num_tiles(cfg, launch.params)
    kernel = get_kernel(cfg.spec(), device)
    if cfg.cluster_n > 1:
        resident = kernel.max_active_clusters((cfg.num_threads,), (cfg.cluster_n,))
        slots = max(1, min(resident, sm_count // cfg.cluster_n))
    else:
        slots = sm_count
    grid = min(tiles, slots) * cfg.cluster_n
    args: list[Any] = [launch.params, launch.epilogue_params]
    if grid:
        args += [t.raw for t in launch.tensor_maps()]
    return PreparedGemm(kernel, grid, cfg.num_threads, (cfg.cluster_n, 1, 1), args)


CHECK_LAYOUT_SPEC = KernelSpec(
    name="fp8_gemm_check_group_layout",
    source="gemm/check_group_layout.cu",
    entry="megamoe_rt::gemm::check_group_layout",
    block_threads=32,
    params=(GemmParams, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64),
)


def prepare_layout_check(launch: GemmLaunch, *, device: int, state: int, error_report: int) -> PreparedGemm:
    """The one-thread check of the group layout that runs before the GEMM: it writes the word at
    ``state`` (which the GEMM's ``layout_state`` must point to) and reports a bad entry into the
    :class:`~megamoe_rt.runtime.error_report.ErrorReport` at ``error_report``."""
    from megamoe_rt.kernels.loader import get_kernel

    if launch.params.layout_state != state:
        raise ValueError("prepare_layout_check: the GEMM's params.layout_state must be the checked state word")
    kernel = get_kernel(CHECK_LAYOUT_SPEC, device)
    return PreparedGemm(
        kernel,
        1,
        32,
        (1, 1, 1),
        [
            launch.params,
            ctypes.c_uint32(launch.config.block_m),
            ctypes.c_uint32(LAYOUTS[launch.config.layout]),
            ctypes.c_uint64(state),
            ctypes.c_uint64(error_report),
        ],
    )
