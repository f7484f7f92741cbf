"""What a layer call moves between ranks beyond one NVLink domain, and the time floor that puts
under it (`megamoe-rt scaleout`, docs/SCALEOUT.md).

Under uniform routing (each token picks ``num_topk`` distinct experts uniformly out of
``num_experts``, split evenly over ``num_ranks``), per rank and call:

- **Dispatch**: every pair routed to another rank moves the token's row there: ``hidden``
  e4m3 bytes, ``hidden / 128`` fp32 scales, and the 8-byte send-list entry the owner reads
  first (the pull of cuda_src/ep). A pair goes to another rank with probability
  ``(R - 1) / R``. A design that sends a token once per destination rank instead of once per
  pair moves ``(R - 1) * (1 - q)`` rows a token, ``q = C(E - E/R, K) / C(E, K)`` being the
  chance that a given rank holds none of the token's experts (shown as ``dedup``).
- **Combine**: every remote pair's bf16 partial comes back, ``2 * hidden`` bytes. Summing a
  token's partials on the expert side first would change the order of the top-k sum that
  the numerics contract fixes (slot order), so the partials travel one per pair.
- By symmetry a rank receives what it sends; with full-duplex links the floor is the bytes
  one way over the per-GPU bandwidth.

The layer's own time is at least the larger of its useful FLOPs (``2 * pairs * H * 2I +
2 * pairs * I * H``) at a measured rate and one read of the rank's expert weights from HBM
(small calls); the layer hides the transfers only if they fit under it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megamoe_rt.presets import Preset

SEND_LIST_ENTRY_BYTES = 8  # (weight bits << 32) | token * K + slot, read by the owner before the row
IB_400G_BYTES_PER_S = 400e9 / 8  # one 400 Gb/s NIC per GPU, one direction
NVLINK_BYTES_PER_S = 395e9  # GPU0 -> GPU1 copy measured on the H200s (bench/NOTES.md ceilings)
HBM_BYTES_PER_S = 4.3e12  # device copy measured on the same H200s


def dispatch_row_bytes(hidden: int) -> int:
    """Bytes one pulled row costs: the e4m3 row, its 1x128 scales and its send-list entry."""
    return hidden + hidden // 128 * 4 + SEND_LIST_ENTRY_BYTES


def rank_miss_probability(num_experts: int, num_topk: int, num_ranks: int) -> float:
    """The chance that a given rank holds none of a token's ``num_topk`` distinct experts."""
    local = num_experts // num_ranks
    return math.comb(num_experts - local, num_topk) / math.comb(num_experts, num_topk)


@dataclass(frozen=True)
class ScaleoutCost:
    preset: str
    num_ranks: int
    tokens: int  # per rank
    dispatch_bytes: float  # per rank, one way
    dispatch_dedup_bytes: float  # the same with one row per (token, destination rank)
    combine_bytes: float
    link_bytes_per_s: float
    comm_floor_us: float
    comm_floor_dedup_us: float
    gemm_us: float  # the useful FLOPs at ``tflops``
    weight_read_us: float  # the rank's expert weights (e4m3 and scales) read once from HBM
    tflops: float

    @property
    def layer_us(self) -> float:
        """The layer's own time floor: FLOPs or one weight read, whichever is longer."""
        return max(self.gemm_us, self.weight_read_us)

    @property
    def comm_over_layer(self) -> float:
        return self.comm_floor_us / self.layer_us

    def as_dict(self) -> dict:
        return {**asdict(self), "layer_us": self.layer_us, "comm_over_layer": self.comm_over_layer}


def scaleout_cost(
    preset: Preset,
    num_ranks: int,
    tokens: int,
    *,
    link_bytes_per_s: float = IB_400G_BYTES_PER_S,
    tflops: float = 780.0,
) -> ScaleoutCost:
    """Per-rank traffic and time floor of one call of ``preset`` over ``num_ranks`` ranks with
    ``tokens`` tokens per rank (module docstring). ``tflops``: the layer's GEMM rate (the fused
    layer measured 770-780 on one H200 at 8192 tokens)."""
    if num_ranks < 2 or preset.num_experts % num_ranks:
        raise ValueError(f"num_ranks={num_ranks}: expected a divisor >= 2 of num_experts={preset.num_experts}")
    if tokens < 0:
        raise ValueError(f"tokens={tokens}: expected >= 0")
    if link_bytes_per_s <= 0 or tflops <= 0:
        raise ValueError("link_bytes_per_s and tflops must be positive")
    h, i, k, r = preset.hidden, preset.intermediate, preset.num_topk, num_ranks
    remote_pairs = tokens * k * (r - 1) / r
    remote_ranks = tokens * (r - 1) * (1.0 - rank_miss_probability(preset.num_experts, k, r))
    dispatch = remote_pairs * dispatch_row_bytes(h)
    dedup = remote_ranks * (dispatch_row_bytes(h) - SEND_LIST_ENTRY_BYTES) + remote_pairs * SEND_LIST_ENTRY_BYTES
    combine = remote_pairs * 2 * h
    flops = 2.0 * tokens * k * h * 2 * i + 2.0 * tokens * k * i * h  # every rank computes T * K pairs on average
    local = preset.num_experts // r
    weights = local * (3 * h * i + (3 * h * i) // (128 * 128) * 4)  # w1 [2I, H] and w2 [H, I], e4m3 + block scales
    return ScaleoutCost(
        preset=preset.name,
        num_ranks=r,
        tokens=tokens,
        dispatch_bytes=dispatch,
        dispatch_dedup_bytes=dedup,
        combine_bytes=combine,
        link_bytes_per_s=link_bytes_per_s,
        comm_floor_us=(dispatch + combine) / link_bytes_per_s * 1e6,
        comm_floor_dedup_us=(dedup + combine) / link_bytes_per_s * 1e6,
        gemm_us=flops / (tflops * 1e12) * 1e6,
        weight_read_us=weights / HBM_BYTES_PER_S * 1e6,
        tflops=tflops,
    )


def format_table(costs: list[ScaleoutCost]) -> str:
    """A markdown table, a row per cost."""
    head = (
        "| preset | ranks | tokens/rank | dispatch MB | (dedup) | combine MB | link floor us | (dedup) "
        "| GEMM us | weight read us | link floor / layer |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [
        f"| {c.preset} | {c.num_ranks} | {c.tokens} | {c.dispatch_bytes / 1e6:.1f} | {c.dispatch_dedup_bytes / 1e6:.1f} "
        f"| {c.combine_bytes / 1e6:.1f} | {c.comm_floor_us:.0f} | {c.comm_floor_dedup_us:.0f} | {c.gemm_us:.0f} "
        f"| {c.weight_read_us:.0f} | {c.comm_over_layer:.2f} |"
        for c in costs
    ]
    return "\n".join([head, *rows])
