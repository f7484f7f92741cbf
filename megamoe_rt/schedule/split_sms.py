"""SM counts of the split pipeline (no GPU): K1 and K2 side by side, K3 after both.

K1 (routing, dispatch, L1 + SwiGLU + requant) and K2 (L2 + scatter) run concurrently in
disjoint green-context partitions carved one after the other: K1's count is split off the
whole device, K2's off what K1 leaves. K3 (the top-k reduce) runs once both are done, so its
partition is carved from the whole device again. Partitions come in multiples of the
device's granularity (8 SMs on Hopper), except the last carve: K2 may take exactly every SM
K1 leaves, and K3 may take the whole device (measured on an H200:
bench/results/green_splits_h200_2026-12-01.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megamoe_rt.runtime import args

# L1 does twice L2's FLOPs per routed pair (2I x H against H x I), and K1 also dispatches:
# the default gives K1 about two thirds of the SMs.
L1_SHARE_NUM, L1_SHARE_DEN = 2, 3


@dataclass(frozen=True)
class SplitSms:
    """SMs of K1 and K2 (disjoint, concurrent) and of K3 (after both)."""

    l1: int
    l2: int
    reduce: int

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.l1, self.l2, self.reduce)


def _multiples(granularity: int, most: int) -> list[int]:
    return list(range(granularity, most + 1, granularity))


def valid_l1_counts(total_sms: int, granularity: int) -> list[int]:
    """K1 counts that leave K2 at least one partition."""
    return _multiples(granularity, total_sms - granularity)


def valid_l2_counts(total_sms: int, granularity: int, l1: int) -> list[int]:
    """K2 counts once K1 has ``l1``: multiples of the granularity, or every SM left."""
    left = total_sms - l1
    counts = _multiples(granularity, left)
    if left not in counts:
        counts.append(left)
    return counts


def valid_reduce_counts(total_sms: int, granularity: int) -> list[int]:
    counts = _multiples(granularity, total_sms)
    if total_sms not in counts:
        counts.append(total_sms)
    return counts


def _shown(counts: Sequence[int]) -> str:
    if len(counts) <= 8:
        return ", ".join(map(str, counts))
    return f"{counts[0]}, {counts[1]}, ..., {counts[-2]}, {counts[-1]}"


def _count(name: str, value: object) -> int:
    return args.integer(f"split_sms.{name}", value)


def check_split_sms(sms: SplitSms | Sequence[int], total_sms: int, granularity: int) -> SplitSms:
    """``sms`` as a :class:`SplitSms` the device can form; ValueError listing the valid counts."""
    if not isinstance(sms, SplitSms):
        if isinstance(sms, (str, bytes)) or len(sms) != 3:
            raise TypeError(f"split_sms: expected (l1, l2, reduce) SM counts or a SplitSms, got {sms!r}")
        sms = SplitSms(*(_count(n, v) for n, v in zip(("l1", "l2", "reduce"), sms)))
    l1, l2, reduce = (_count(n, getattr(sms, n)) for n in ("l1", "l2", "reduce"))
    ok_l1 = valid_l1_counts(total_sms, granularity)
    if l1 not in ok_l1:
        raise ValueError(
            f"split_sms: K1 gets {l1} SMs; on this {total_sms}-SM device it takes a multiple of "
            f"{granularity} that leaves K2 some: {_shown(ok_l1)}"
        )
    ok_l2 = valid_l2_counts(total_sms, granularity, l1)
    if l2 not in ok_l2:
        raise ValueError(
            f"split_sms: K2 gets {l2} SMs; with {l1} for K1 it takes a multiple of {granularity} "
            f"or all {total_sms - l1} left: {_shown(ok_l2)}"
        )
    ok_reduce = valid_reduce_counts(total_sms, granularity)
    if reduce not in ok_reduce:
        raise ValueError(
            f"split_sms: K3 gets {reduce} SMs; it takes a multiple of {granularity} or the whole "
            f"device ({total_sms}): {_shown(ok_reduce)}"
        )
    return SplitSms(l1, l2, reduce)


def default_split_sms(total_sms: int, granularity: int) -> SplitSms:
    """About two thirds of the SMs to K1 (rounded down to the granularity), the rest to K2,
    the whole device to K3 (132 SMs: 88 / 44 / 132)."""
    l1 = max(granularity, total_sms * L1_SHARE_NUM // L1_SHARE_DEN // granularity * granularity)
    l1 = min(l1, valid_l1_counts(total_sms, granularity)[-1])
    return SplitSms(l1, total_sms - l1, total_sms)


def sweep_split_sms(total_sms: int, granularity: int, step: int | None = None) -> list[SplitSms]:
    """The K1/K2 splits ``tune-split`` tries: K1 every ``step`` SMs (default the granularity)
    from a quarter to seven eighths of the device, K2 every SM left, K3 the whole device."""
    step = step or granularity
    lo, hi = total_sms // 4, total_sms * 7 // 8
    out = []
    for l1 in valid_l1_counts(total_sms, granularity):
        if lo <= l1 <= hi and (l1 - granularity) % step == 0:
            out.append(SplitSms(l1, total_sms - l1, total_sms))
    return out
