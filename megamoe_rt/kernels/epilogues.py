"""Epilogues of the grouped FP8 GEMM: what the math warpgroups do with a finished tile.

Each epilogue is a C++ policy type in its own header under ``cuda_src/gemm/`` (the interface
is described at ``Config::Epilogue`` in gemm/config.cuh) with its own parameter struct, the
kernel's second argument. A GEMM variant names the type as the kernel's last template argument
and is compiled with the header pre-included, so the kernel source includes no epilogue itself.

Adding an epilogue: declare its parameter struct in megamoe_rt/kernels/interface/gemm.py
(``python -m megamoe_rt.kernels.interface`` writes the C++ and ctypes sides), write its header
(``using Params = ...;`` and ``store``), then :func:`register` it below with the constraints
its tiles have. :func:`~megamoe_rt.kernels.gemm_heuristics.candidate_configs` then builds
its variants (``megamoe-rt compile --all``, the CPU suite) and :class:`GemmConfig` checks them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

from megamoe_rt.kernels.interface.structs import ScatterBf16Params, StoreBf16Params, SwigluFp8Params

# A reason a tile configuration does not suit the epilogue, or None. Called with the
# GemmConfig fields as keywords: block_m, block_n, b_sf_n, out_sf_gran, a_sf_gran, layout,
# epilogue, cluster_n (and stages, when a whole GemmConfig is checked).
Rule = Callable[..., "str | None"]


@dataclass(frozen=True)
class Epilogue:
    name: str  # GemmConfig.epilogue, and the variant names
    cxx_type: str  # the policy type
    header: str  # its header, relative to cuda_src/
    params: type[ctypes.Structure]  # the policy's Params: the kernel's second argument
    b_sf_n: int = 128  # B scales per 64 or 128 output columns in the variants built
    requant: bool = False  # writes e4m3 with its own scales in groups of out_sf_gran
    # What compile --all and the heuristics build: group layouts, A-scale granularities and
    # (when requant) the requant groups.
    layouts: tuple[str, ...] = ("contiguous", "masked")
    a_sf_grans: tuple[int, ...] = (128, 64)
    out_sf_grans: tuple[int, ...] = (128,)
    rule: Rule | None = None

    def problem(self, **config: object) -> str | None:
        """Why a configuration (GemmConfig fields as keywords) cannot use this epilogue, or None."""
        return self.rule(**config) if self.rule is not None else None


EPILOGUES: dict[str, Epilogue] = {}


def register(epilogue: Epilogue) -> Epilogue:
    if epilogue.name in EPILOGUES:
        raise ValueError(f"epilogue {epilogue.name!r} is registered twice")
    EPILOGUES[epilogue.name] = epilogue
    return epilogue


def get_epilogue(name: str) -> Epilogue:
    try:
        return EPILOGUES[name]
    except KeyError:
        raise ValueError(f"epilogue {name!r} unknown; registered: {', '.join(EPILOGUES)}") from None


def _swiglu_rule(*, block_m: int, block_n: int, b_sf_n: int, out_sf_gran: int, **_: object) -> str | None:
    if b_sf_n != 64:
        return "the SwiGLU epilogue needs 64-column B scales (interleaved gate|up halves)"
    if out_sf_gran == 128 and block_n != 256:
        # A 128-wide group is 256 interleaved gate|up columns: two warpgroups side by side
        # (64x256) or one warpgroup's two passes (128x256).
        return "128-wide requant groups need a 256-column tile (64x256 or 128x256)"
    return None


register(Epilogue("bf16", "megamoe_rt::gemm::StoreBf16Epilogue", "gemm/epilogue_bf16.cuh", StoreBf16Params))
# Built for the contiguous layout only: the MoE layer scatters from its contiguous pools.
register(
    Epilogue(
        "scatter_bf16",
        "megamoe_rt::gemm::ScatterBf16Epilogue",
        "gemm/epilogue_scatter_bf16.cuh",
        ScatterBf16Params,
        layouts=("contiguous",),
    )
)
register(
    Epilogue(
        "swiglu_fp8",
        "megamoe_rt::gemm::SwigluFp8Epilogue",
        "gemm/epilogue_swiglu_fp8.cuh",
        SwigluFp8Params,
        b_sf_n=64,
        requant=True,
        a_sf_grans=(128,),
        out_sf_grans=(64, 128),
        rule=_swiglu_rule,
    )
)
