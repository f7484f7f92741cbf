"""Every rank decides the same about a call across ranks.

A layer call across ranks is collective: if one rank refuses its inputs and does not launch,
its peers' kernels wait for it until their deadline and trap. So before launching, every rank
posts what it found (an argument error, its ``num_tokens_bound``, its layer settings, whether
it is capturing, whether its device has reported refused inputs) and reads everyone's (one
:meth:`RankGroup.allgather`); from the same list every rank raises the same error, or all
launch. The exchange is host-side only, so it also runs while a call is being captured into a
graph (the graph is then never made).

Construction and NVSHMEM's host collectives agree the same way. Constructing a layer, every
rank posts its settings (or the error its arguments raised) and all compare them
(:func:`agree_on_construction`). Before each NVSHMEM host collective (start-up, allocation,
free, finalize; not the on-stream barrier, which is only enqueued on the host), which cannot be
interrupted once entered, the ranks meet over the
group's host channel, which has deadlines, and say whether each is able to enter
(:func:`enter_together`): all enter, or all raise the error of the rank that is not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
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
    "MemoryError": MemoryError,
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
        raise ValueError(
            f"MegaMoE: the ranks' layers differ ({settings}: digests of their agreed settings, so the ranks "
            "call layers constructed differently, or different layers); call the same layer on every rank"
        )
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
    NVSHMEM allocation would wait for them forever). A collective. The layer compares all its
    settings, and its argument errors, with :func:`agree_on_construction` instead."""
    seen = [raw.decode() for raw in group.allgather(arguments.encode(), key="layer-construction")]
    if len(set(seen)) > 1:
        listing = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise ValueError(
            f"MegaMoE: the ranks construct different layers ({listing}); construct them alike on every rank"
        )


# --- construction ------------------------------------------------------------------------------


def settings_text(settings: Mapping[str, object]) -> str:
    """``settings`` (name -> value) as the text ranks compare: each value's repr, by name."""
    return json.dumps({name: repr(value) for name, value in sorted(settings.items())}, separators=(",", ":"))


def settings_digest(text: str) -> str:
    """A short digest of :func:`settings_text`'s text: what every call compares (cheap to post)."""
    return "settings:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_differences(texts: list[str]) -> str:
    """The settings that differ between the ranks' :func:`settings_text` texts, each with
    every rank's value: ``"swiglu_limit (rank 0: None, rank 1: 7.0)"``, ``"; "``-joined."""
    per_rank = [json.loads(t) if t else {} for t in texts]
    names = sorted({name for s in per_rank for name in s})
    parts = []
    for name in names:
        values = [s.get(name, "<not set>") for s in per_rank]
        if len(set(values)) > 1:
            parts.append(f"{name} (" + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)) + ")")
    return "; ".join(parts)


def _post_with_error(exc: BaseException | None, *rest: object) -> bytes:
    """``[error type, message, *rest]`` as JSON bytes, the message cut (by encoded size, as in
    :meth:`CallStatus.encode`) until the whole fits one slot of the exchange."""
    error_type = None if exc is None else type(exc).__name__
    error = None if exc is None else str(exc)
    while True:
        raw = json.dumps([error_type, error, *rest]).encode()
        if len(raw) <= _MAX_BYTES or not error:
            return raw
        error = error[: len(error) // 2] + " [...]"


def refusal(what: str, failed: list[tuple[int, str, str]]) -> Exception:
    """One error for every rank about the ``(rank, error type, message)`` in ``failed``: the
    first failing rank's type (TypeError, ValueError, RuntimeError, MemoryError; anything else
    a RuntimeError), naming every failing rank and its error. Raise it from this rank's own
    exception, if any."""
    first_rank, first_type, _ = failed[0]
    kind = _RAISED_AS.get(first_type, RuntimeError)
    more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    lines = "\n  ".join(f"rank {r}: {t}: {m}" for r, t, m in failed)
    return kind(f"{what}: failed on rank {first_rank}{more}, so on every rank:\n  {lines}")


def agree_on_construction(
    group: RankGroup, settings: Mapping[str, object], failure: BaseException | None = None
) -> None:
    """Every rank constructs its layer with valid arguments and the same ``settings`` (every
    setting the ranks must share: MegaMoE's agreed settings), or every rank raises the same
    error before any rank enters a collective the others skip (an NVSHMEM allocation would wait
    for them forever). ``failure``: what this rank's arguments raised. A rank's failure is
    raised on every rank as its type (a bad argument seen only on that rank is a ValueError or
    TypeError everywhere), naming the rank; otherwise settings that differ are one ValueError
    naming each setting and every rank's value. A collective."""
    text = "" if failure is not None else settings_text(settings)
    raw = _post_with_error(failure, text)
    seen = [json.loads(r) for r in group.allgather(raw, key="layer-construction")]
    failed = [(r, t, m) for r, (t, m, _) in enumerate(seen) if t is not None]
    if failed:
        raise refusal("MegaMoE construction", failed) from failure
    texts = [t for _, _, t in seen]
    if len(set(texts)) > 1:
        raise ValueError(
            f"MegaMoE: the ranks construct different layers: {describe_differences(texts)}; "
            "construct them alike on every rank"
        )


# --- NVSHMEM's host collectives ----------------------------------------------------------------


def gather_failures(
    group: RankGroup, what: str, failure: BaseException | None = None, same: Mapping[str, object] | None = None
) -> list[tuple[int, str, str]]:
    """The ranks meet at step ``what`` and say how each fared: ``(rank, error type, message)``
    of every rank that failed (``failure`` is this rank's error, or None), in rank order; empty
    when none did. ``same``: settings every rank must pass alike; when they differ (and no rank
    failed) every rank raises one ValueError naming each setting and every rank's value. A rank
    that does not come within the group's deadline, or has ended, raises here on the ranks that
    came, naming ``what`` (a TimeoutError for the deadline, else a RuntimeError). A collective."""
    text = "" if same is None else settings_text(same)
    try:
        seen = group.allgather(_post_with_error(failure, text), key=what)
    except Exception as exc:
        mine = "" if failure is None else f"; this rank failed too ({type(failure).__name__}: {failure})"
        kind = TimeoutError if isinstance(exc, TimeoutError) else RuntimeError
        raise kind(f"{what}: the ranks did not all meet ({exc}){mine}") from exc
    decoded = [json.loads(raw) for raw in seen]
    failed = [(r, t, m) for r, (t, m, _) in enumerate(decoded) if t is not None]
    texts = [t for _, _, t in decoded]
    if not failed and len(set(texts)) > 1:
        raise ValueError(f"{what}: the ranks differ in {describe_differences(texts)}; set them alike on every rank")
    return failed


def enter_together(
    group: RankGroup, collective: str, failure: BaseException | None = None, same: Mapping[str, object] | None = None
) -> None:
    """Right before NVSHMEM host collective ``collective``, which cannot be interrupted once
    entered (a rank that never enters it leaves the others inside it for good): the ranks meet
    over the group's host channel, which has deadlines, and every rank enters, or none does and
    every rank raises the same error naming the rank that could not (``failure``: this rank's
    reason, or None) and its error. A peer that does not come in time, or has ended, is raised
    here, naming ``collective``. ``same``: as for :func:`gather_failures`. A collective."""
    failed = gather_failures(group, f"before {collective}", failure, same)
    if failed:
        raise refusal(f"{collective} (entered by no rank)", failed) from failure
