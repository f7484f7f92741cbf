"""The fault suite's runner (the faults themselves need a GPU: bench/results/faults_*.md)."""

from __future__ import annotations

import pytest

from megamoe_rt.cli import faults


def test_unknown_faults_are_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        faults.main(["--only", "nope"])
    assert "unknown fault 'nope'" in capsys.readouterr().err


def test_the_table_has_a_row_per_fault_and_escapes_pipes():
    rows = [
        faults.FaultRow("a", "x", "ValueError: p|q", 0.5, "yes", 1.0, False),
        faults.FaultRow("b", "y", "HANG: no result within 1 s", None, None, 1.0, True),
    ]
    text = faults.markdown(rows)
    assert text.count("\n") == 4 and "p/q" in text and "| 0.500 s |" in text and "| yes |" in text


def test_every_fault_the_issue_lists_has_a_scenario():
    assert {
        "withheld_signal",
        "rank_killed_mid_call",
        "single_wave_past_ring",
        "ring_too_small",
        "bad_input_one_rank",
        "planted_cache_entry",
        "weights_reloaded_under_graph",
        "timeout_zero",
        "timeout_huge",
    } <= set(faults._SCENARIOS)
