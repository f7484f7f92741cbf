"""What a layer's kernels reported about refused inputs, and when the layer raises it.

The kernels store findings into mapped host memory (:class:`~megamoe_rt.runtime.error_report.ErrorReport`)
and never stop; looking costs no wait. Only when something is there does the layer wait for its
device (so that no call still running reports after the report is taken), then raise
:class:`DeviceInputError` naming the argument at fault. Across ranks raising is a collective:
every rank takes its own findings and all raise the union (docs/USAGE.md, "Errors found on the
device").
"""

from __future__ import annotations

from dataclasses import replace

from megamoe_rt.ep import agreement
from megamoe_rt.ep.group import RankGroup
from megamoe_rt.runtime import driver
from megamoe_rt.runtime.error_report import ErrorReport
from megamoe_rt.runtime.errors import DeviceInputError, Finding

# Report kinds about expert ids (the ones validate_ids=False leaves unraised).
ID_ERRORS = ("expert_id_out_of_range", "repeated_expert_id")


def describe_findings(findings: tuple[Finding, ...], num_topk: int, num_experts: int, rank: int | None) -> str:
    """One message for the findings of a layer's report, naming the argument at fault
    (``rank``: the rank's number across ranks, else None)."""
    k, lines = num_topk, []
    for f in findings:
        token, slot = divmod(f.where, k)
        if f.kind == "expert_id_out_of_range":
            lines.append(
                f"topk_idx: expert id outside [-1, {num_experts}) "
                f"(e.g. topk_idx[{token}, {slot}] = {f.what_signed}); the slot was treated as empty"
            )
        elif f.kind == "repeated_expert_id":
            lines.append(
                f"topk_idx: expert repeated within a token's top-k (e.g. topk_idx[{token}, {slot}] "
                f"= {f.what_signed} repeats an earlier slot of token {token}); the later slot was dropped"
            )
        elif f.kind == "pool_overflow":
            lines.append(
                f"topk_idx: the routing needs {f.where} rows of the expert pool, the buffer holds {f.what}; "
                "the rows past it were not computed"
            )
        else:
            lines.append(f"{f.kind}: details {f.where}, {f.what}")
    where = "" if rank is None else f" (rank {rank})"
    return f"MegaMoE{where}: inputs refused on the device by an earlier call:\n  " + "\n  ".join(lines)


class LayerReports:
    """One layer's report and the rules for raising it (``group`` None: one rank)."""

    def __init__(
        self,
        device: int,
        *,
        num_topk: int,
        num_experts: int,
        validate_ids: bool,
        group: RankGroup | None,
        rank: int,
        settings: str,
    ) -> None:
        self.device = device
        self.num_topk, self.num_experts = num_topk, num_experts
        self.validate_ids = validate_ids
        self.group, self.rank = group, rank
        self.settings = settings  # the digest every call across ranks posts
        self.report = ErrorReport(device)
        self.closed = False

    @property
    def device_ptr(self) -> int:
        return self.report.device_ptr

    def _kept(self, findings: tuple[Finding, ...]) -> tuple[Finding, ...]:
        return findings if self.validate_ids else tuple(f for f in findings if f.kind not in ID_ERRORS)

    def pending(self, capturing: bool = False) -> bool:
        """Whether the device has reported something the layer raises (no wait). Nothing is
        raised while capturing: a wait would break the capture, the report stays for later."""
        if capturing or self.closed:
            return False
        return self.report.pending(ignore=() if self.validate_ids else ID_ERRORS)

    def raise_pending(self, *, wait: bool) -> None:
        """One rank: raise what is reported (``wait``: wait for the device first in any case).
        Every call in flight finishes before the report is cleared, so that a call still
        reporting cannot write after the clear; only errors (and ``wait``) wait."""
        if not wait and not self.pending():
            return
        driver.synchronize_device(self.device)
        findings = self._kept(self.report.take())
        if findings:
            rank = self.rank if self.group is not None else None
            raise DeviceInputError(describe_findings(findings, self.num_topk, self.num_experts, rank), findings)

    def agree_pending(self, *, key: str, closed_error: Exception | None) -> bool:
        """Across ranks: whether any rank has a report pending; a closed layer on any rank is
        raised on every rank (the exchange comes first, so no rank is left waiting)."""
        assert self.group is not None, "only across ranks"
        if closed_error is not None:
            status = agreement.CallStatus.of_error(closed_error, settings=self.settings)
        else:
            status = agreement.CallStatus(reports_pending=self.pending(), settings=self.settings)
        statuses = agreement.exchange(self.group, status, key=key)
        agreement.raise_if_refused(statuses, closed_error)
        return any(s.reports_pending for s in statuses)

    def agree_on_call(self, bound: int | None, *, capturing: bool, local: BaseException | None) -> bool:
        """Across ranks, before a call launches: the ranks exchange what each found (an argument
        error ``local``, the call's ``bound``, a pending report, whether it is capturing) and all
        go on or all raise the same error; reports pending anywhere are raised on every rank
        unless some rank is capturing. Returns whether reports may be raised after the call."""
        assert self.group is not None, "only across ranks"
        status = agreement.CallStatus.of_error(local) if local else agreement.CallStatus(bound=bound)
        pending = self.pending(capturing)
        status = replace(status, reports_pending=pending, capturing=capturing, settings=self.settings)
        statuses = agreement.exchange(self.group, status)
        agreement.raise_if_refused(statuses, local)
        if any(s.capturing for s in statuses):  # a wait would break the capture: a later call raises
            return False
        if any(s.reports_pending for s in statuses):
            self.raise_across_ranks()
        return True

    def raise_across_ranks(self) -> None:
        """Every rank waits for its device and takes its report; all raise the union (a collective)."""
        assert self.group is not None, "only across ranks"
        findings: tuple[Finding, ...] = ()
        failure = None
        try:
            driver.synchronize_device(self.device)
            findings = self.report.take()
        except Exception as exc:  # a sticky device error: every rank must hear of it
            failure = exc
        per_rank = [self._kept(fs) for fs in agreement.exchange_findings(self.group, findings, failure)]
        if any(per_rank):
            text = "\n".join(
                describe_findings(fs, self.num_topk, self.num_experts, r) for r, fs in enumerate(per_rank) if fs
            )
            raise DeviceInputError(text, tuple(f for fs in per_rank for f in fs))

    def close(self) -> None:
        self.closed = True
        self.report.close()
