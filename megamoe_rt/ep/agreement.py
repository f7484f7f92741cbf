"""Every rank decides the same about a call across ranks.

A layer call across ranks is collective: if one rank refuses its inputs and does not launch,
its peers' kernels wait for it until their deadline and trap. So before launching, every rank
posts what it found (an argument error, its ``num_tokens_bound``, its layer settings, whether
it is capturing, whether its device has reported refused inputs) and reads everyone's (one
:meth:`RankGroup.allgather`); from the same list every rank raises the same error, or all
launch. The exchange is host-side only, so it also runs while a call is being captured into a
graph (the graph is then never made).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megamoe_rt.ep.group import RankGroup
from megamoe_rt.runtime.errors import Finding

# An encoded status stays well inside one slot of the launcher's status board (4 KiB).
_MAX_BYTES = 2048
# Exception types a refused call is raised as on every rank; anything else becomes a RuntimeError.
_RAISED_AS: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
}


@dataclass(frozen=True)
class CallStatus:
    """What one rank found before launching a call (or before checking reports)."""

    error_type: str | None = None  # the exception's class name
    error: str | None = None  # its message
    bound: int | None = None  # num_tokens_bound, when the arguments were valid
    reports_pending: bool = False  # the device has reported refused inputs of an earlier call
    capturing: bool = False  # the call is being captured into a graph
    settings: str = ""  # layer settings every rank must share (they decide later collectives)

    def encode(self) -> bytes:
        error = self.error
        while True:
            raw = json.dumps(
                [self.error_type, error, self.bound, self.reports_pending, self.capturing, self.settings]
            ).encode()
            if len(raw) <= _MAX_BYTES or not error:
                return raw
            error = error[: len(error) // 2] + " [...]"

    @classmethod
    def decode(cls, raw: bytes) -> CallStatus:
        error_type, error, bound, pending, capturing, settings = json.loads(raw)
        return cls(error_type, error, bound, bool(pending), bool(capturing), settings)

    @classmethod
    def of_error(cls, exc: BaseException, *, settings: str = "") -> CallStatus:
        return cls(type(exc).__name__, str(exc), settings=settings)


def exchange(group: RankGroup, status: CallStatus, *, key: str = "call-status") -> list[CallStatus]:
    """Every rank's status, in rank order (a collective: every rank calls it)."""
    return [CallStatus.decode(raw) for raw in group.allgather(status.encode(), key=key)]


def raise_if_refused(statuses: list[CallStatus], local: BaseException | None) -> None:
    """Raise, on every rank alike, the first rank's error, else differing settings, else a
    bound mismatch. The error names the rank at fault; on that rank it is chained to the
    original exception."""
    failed = [(r, s) for r, s in enumerate(statuses) if s.error_type is not None]
    if failed:
        first_rank, first = failed[0]
        assert first.error_type is not None
        kind = _RAISED_AS.get(first.error_type, RuntimeError)
        lines = [f"rank {r}: {s.error}" for r, s in failed]
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        message = f"MegaMoE call refused on rank {first_rank}{more}, so on every rank:\n  " + "\n  ".join(lines)
        raise kind(message) from local
    settings = [s.settings for s in statuses]
    if len(set(settings)) > 1:
        raise ValueError(f"MegaMoE: the ranks' layers differ ({settings}); construct them alike on every rank")
    bounds = [s.bound for s in statuses]
    if len(set(bounds)) > 1:
        raise ValueError(f"num_tokens_bound: ranks passed {bounds}; it must be the same on every rank")


def exchange_findings(
    group: RankGroup, findings: tuple[Finding, ...], error: BaseException | None = None
) -> list[tuple[Finding, ...]]:
    """Every rank's device findings, in rank order (a collective). A rank that could not
    collect its findings (``error``: its device wait failed) makes every rank raise."""
    text = None if error is None else f"{type(error).__name__}: {error}"[:1000]
    raw = json.dumps([text, [[f.kind, f.where, f.what] for f in findings]]).encode()
    decoded = [json.loads(r) for r in group.allgather(raw, key="device-findings")]
    failed = [(r, t) for r, (t, _) in enumerate(decoded) if t]
    if failed:
        lines = "; ".join(f"rank {r}: {t}" for r, t in failed)
        raise RuntimeError(f"MegaMoE: collecting device reports failed on rank {failed[0][0]} ({lines})") from error
    return [tuple(Finding(kind, where, what) for kind, where, what in fs) for _, fs in decoded]


def require_same_construction(group: RankGroup, arguments: str) -> None:
    """Every rank constructs its layer with the same ``arguments`` (the text of those that
    decide which collectives the construction makes, such as the transport); otherwise the
    same ValueError on every rank, before any rank enters a collective the others skip (an
    NVSHMEM allocation would wait for them forever). A collective."""
    seen = [raw.decode() for raw in group.allgather(arguments.encode(), key="layer-construction")]
    if len(set(seen)) > 1:
        listing = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise ValueError(
            f"MegaMoE: the ranks construct different layers ({listing}); construct them alike on every rank"
        )
