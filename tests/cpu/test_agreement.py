"""Every rank decides the same about a call across ranks (megamoe_rt/ep/agreement.py)."""

from __future__ import annotations

import pytest

from megamoe_rt.ep import agreement
from megamoe_rt.ep.agreement import CallStatus
from megamoe_rt.ep.launch import RankFailed, spawn
from megamoe_rt.runtime.errors import Finding
from tests.helpers import ranks


def test_status_round_trips():
    for s in (CallStatus(), CallStatus("TypeError", "x: dtype float32", None, True), CallStatus(bound=64)):
        assert CallStatus.decode(s.encode()) == s


@pytest.mark.parametrize("text", ["x" * 10_000, "\u00e9\u4e2d" * 3000, "\x01" * 5000])
def test_long_messages_are_cut_to_fit_the_exchange(text):
    """Escapes grow a message when encoded: the cut is by encoded bytes, not characters."""
    s = CallStatus.of_error(ValueError(text))
    raw = s.encode()
    assert len(raw) <= 2048 and CallStatus.decode(raw).error_type == "ValueError"


def test_all_well_raises_nothing():
    agreement.raise_if_refused([CallStatus(bound=64), CallStatus(bound=64)], None)


def test_the_first_failing_rank_decides_the_type_and_every_failure_is_listed():
    statuses = [CallStatus(bound=64), CallStatus("TypeError", "x: dtype float32"), CallStatus("ValueError", "out: bad")]
    with pytest.raises(TypeError) as info:
        agreement.raise_if_refused(statuses, None)
    text = str(info.value)
    assert "refused on rank 1 (and 1 more rank(s))" in text
    assert "rank 1: x: dtype float32" in text and "rank 2: out: bad" in text


def test_an_unknown_error_type_is_raised_as_runtime_error_chained_to_the_original():
    original = KeyError("k")
    with pytest.raises(RuntimeError) as info:
        agreement.raise_if_refused([CallStatus.of_error(original)], original)
    assert info.value.__cause__ is original


def test_layers_built_differently_on_some_rank_are_refused():
    a, b = CallStatus(bound=8, settings="mode=fused debug=False"), CallStatus(bound=8, settings="mode=fused debug=True")
    with pytest.raises(ValueError, match="the ranks' layers differ"):
        agreement.raise_if_refused([a, b], None)


def test_different_bounds_are_refused_on_every_rank():
    with pytest.raises(ValueError, match=r"num_tokens_bound: ranks passed \[64, 128\]"):
        agreement.raise_if_refused([CallStatus(bound=64), CallStatus(bound=128)], None)


def test_ranks_raise_the_same_error_for_one_rank_s_bad_input():
    """Rank 1's argument error reaches rank 0 through the exchange: both raise, same text."""
    with pytest.raises(RankFailed) as info:
        spawn(ranks.agree_on_a_bad_rank, 2)
    # spawn reports the first failing rank; each rank raised the same message (checked inside).
    assert "refused on rank 1" in str(info.value)


def test_findings_travel_to_every_rank():
    out = spawn(ranks.share_findings, 3)
    expect = [(), (Finding("repeated_expert_id", 5, 3),), (Finding("expert_id_out_of_range", 1, 99),)]
    assert out == [expect] * 3


def test_a_rank_that_cannot_collect_its_reports_makes_every_rank_raise():
    out = spawn(ranks.findings_with_a_failed_rank, 2)
    assert all("collecting device reports failed on rank 1" in text for text in out), out


class _Group:
    """A rank's view of a group whose allgather returns what every rank passed."""

    def __init__(self, everyone):
        self.everyone = everyone

    def allgather(self, value, *, key):
        assert key == "layer-construction"
        return [v.encode() for v in self.everyone]


def test_layers_constructed_alike_pass_and_differing_ones_fail_alike():
    agreement.require_same_construction(_Group(["transport='auto'"] * 2), "transport='auto'")
    messages = set()
    for mine in ("transport='auto'", "transport='nvlink'"):
        with pytest.raises(ValueError, match="construct different layers") as info:
            agreement.require_same_construction(_Group(["transport='auto'", "transport='nvlink'"]), mine)
        messages.add(str(info.value))
    assert len(messages) == 1  # the same error on every rank
    assert "rank 0: transport='auto'; rank 1: transport='nvlink'" in messages.pop()
