"""Model shapes the runtime is tuned and benchmarked for.

A preset describes the whole MoE layer. Expert parallelism splits its experts
over ``DEFAULT_EP_RANKS`` ranks; on a single GPU the runtime runs one rank's
slice of that split (``num_experts // DEFAULT_EP_RANKS`` local experts), so
single-GPU numbers stay comparable with the multi-GPU deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_EP_RANKS", "PRESETS", "Preset", "get_preset"]

DEFAULT_EP_RANKS = 8


@dataclass(frozen=True)
class Preset:
    """One MoE layer shape: hidden size, expert FFN width, expert count, top-k."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int

    def num_local_experts(self, num_ranks: int = DEFAULT_EP_RANKS) -> int:
        """Experts owned by one rank when the layer is split over ``num_ranks``."""
        if num_ranks < 1 or self.num_experts % num_ranks:
            raise ValueError(
                f"num_ranks={num_ranks!r}: expected a positive divisor of "
                f"num_experts={self.num_experts} for preset {self.name!r}"
            )
        return self.num_experts // num_ranks


PRESETS: dict[str, Preset] = {
    name: Preset(name, *shape)
    for name, shape in {
        "flash": (4096, 2048, 256, 6),
        "pro": (7168, 3072, 384, 6),
        "v3": (7168, 2048, 256, 8),
    }.items()
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name; unknown names raise ValueError listing valid ones."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(PRESETS))
        raise ValueError(f"name={name!r}: expected one of {valid}") from None
