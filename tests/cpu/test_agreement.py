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


def test_long_messages_are_cut_to_fit_the_exchange():
    s = CallStatus.of_error(ValueError("x" * 10_000))
    assert s.error_type == "ValueError" and len(s.encode()) < 2000


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
