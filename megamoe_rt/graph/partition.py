"""SM partition arithmetic (no GPU): how a device's SMs split into named partitions.

Partitions are split off the device one after another (megamoe_rt.graph.green), each a
multiple of the granularity: 8 SMs on Hopper with SM co-scheduling kept (what thread-block
clusters need), 2 SMs without it. A request is a count of SMs or ``"rest"``: every SM the
other partitions leave, whatever their number (on an H200: 96 SMs, then the 36 left). SMs
no partition takes are the remainder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Request = int | str


@dataclass(frozen=True)
class PartitionPlan:
    total_sms: int
    granularity: int
    sizes: tuple[tuple[str, int], ...]  # (name, SMs), in request order
    remainder: int

    def size(self, name: str) -> int:
        for n, s in self.sizes:
            if n == name:
                return s
        raise KeyError(name)


def valid_counts(total_sms: int, granularity: int) -> list[int]:
    return list(range(granularity, total_sms - total_sms % granularity + 1, granularity))


def plan_partitions(total_sms: int, granularity: int, requests: Sequence[tuple[str, Request]]) -> PartitionPlan:
    if total_sms <= 0 or granularity <= 0:
        raise ValueError(f"total_sms={total_sms}, granularity={granularity}: expected positive values")
    names = [n for n, _ in requests]
    if len(set(names)) != len(names):
        raise ValueError(f"partition names must be unique, got {names}")
    rest = [n for n, r in requests if r == "rest"]
    if len(rest) > 1:
        raise ValueError(f"at most one partition may take the rest, got {rest}")
    fixed = 0
    for name, req in requests:
        if req == "rest":
            continue
        if isinstance(req, bool) or not isinstance(req, int) or req <= 0 or req % granularity:
            shown = valid_counts(total_sms, granularity)
            raise ValueError(
                f"partition {name!r}: {req!r} SMs is not a positive multiple of {granularity}; "
                f"valid counts on this device: {', '.join(map(str, shown))}"
            )
        fixed += req
    if fixed > total_sms:
        raise ValueError(f"partitions ask for {fixed} SMs; the device has {total_sms}")
    rest_size = total_sms - fixed
    if rest and rest_size == 0:
        raise ValueError(f"partition {rest[0]!r} takes the rest, but the other partitions take all {total_sms} SMs")
    sizes = tuple((n, rest_size if r == "rest" else int(r)) for n, r in requests)
    return PartitionPlan(total_sms, granularity, sizes, total_sms - sum(s for _, s in sizes))
