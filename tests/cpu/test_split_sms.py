"""The split mode's SM counts and its tuning cache (no GPU)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megamoe_rt.graph import split_tuning
from megamoe_rt.schedule.split_sms import (
    SplitSms,
    check_split_sms,
    default_split_sms,
    sweep_split_sms,
    valid_l1_counts,
    valid_l2_counts,
)

H200 = (132, 8)


def test_the_default_gives_k1_two_thirds_k2_the_rest_k3_the_device():
    assert default_split_sms(*H200) == SplitSms(88, 44, 132)
    assert default_split_sms(148, 8) == SplitSms(96, 52, 148)  # the 96/52 of a 148-SM part
    assert default_split_sms(16, 8) == SplitSms(8, 8, 16)


@given(total=st.integers(16, 200), gran=st.sampled_from([2, 8]))
def test_the_default_and_every_swept_split_are_valid_and_disjoint(total, gran):
    for sms in [default_split_sms(total, gran), *sweep_split_sms(total, gran)]:
        assert check_split_sms(sms, total, gran) == sms
        assert sms.l1 + sms.l2 <= total and sms.l1 % gran == 0 and sms.l2 > 0


def test_valid_counts_follow_the_hardware_rules():
    assert valid_l1_counts(*H200) == list(range(8, 125, 8))
    assert valid_l2_counts(132, 8, 96) == [8, 16, 24, 32, 36]  # multiples of 8, or all 36 left
    assert check_split_sms((96, 36, 132), *H200) == SplitSms(96, 36, 132)
    assert check_split_sms((120, 8, 16), *H200) == SplitSms(120, 8, 16)


@pytest.mark.parametrize(
    "sms,message",
    [
        ((60, 64, 132), r"K1 gets 60 SMs.*multiple of 8.*8, 16, \.\.\., 112, 120"),
        ((128, 4, 132), r"K1 gets 128 SMs"),
        ((96, 50, 132), r"K2 gets 50 SMs; with 96 for K1 .* all 36 left: 8, 16, 24, 32, 36"),
        ((64, 64, 100), r"K3 gets 100 SMs.*whole device \(132\)"),
    ],
)
def test_a_split_the_device_cannot_form_is_refused_with_the_valid_choices(sms, message):
    with pytest.raises(ValueError, match=message):
        check_split_sms(sms, *H200)


@pytest.mark.parametrize("bad", [(96, 36), "96,36,132", (96.0, 36, 132), (True, 36, 132)])
def test_split_sms_of_the_wrong_kind_are_a_type_error(bad):
    with pytest.raises(TypeError, match="split_sms"):
        check_split_sms(bad, *H200)


def test_the_tuning_cache_stores_and_finds_the_nearest_token_count(tmp_path):
    key = split_tuning.shape_key("NVIDIA H200", 132, 4096, 2048, 32, 6, 1)
    assert split_tuning.lookup(key, 2048, tmp_path) is None
    split_tuning.store(key, 2048, SplitSms(96, 36, 132), 500.0, tmp_path)
    split_tuning.store(key, 8192, SplitSms(80, 52, 132), 1500.0, tmp_path)
    other = split_tuning.shape_key("NVIDIA H200", 132, 7168, 2048, 32, 8, 1)
    split_tuning.store(other, 2048, SplitSms(64, 68, 132), 600.0, tmp_path)
    assert split_tuning.lookup(key, 2048, tmp_path) == SplitSms(96, 36, 132)
    assert split_tuning.lookup(key, 3000, tmp_path) == SplitSms(96, 36, 132)
    assert split_tuning.lookup(key, 6000, tmp_path) == SplitSms(80, 52, 132)
    assert split_tuning.lookup(other, 1, tmp_path) == SplitSms(64, 68, 132)
    # A damaged file is ignored, never an error.
    split_tuning.tuning_path(tmp_path).write_text("{not json")
    assert split_tuning.lookup(key, 2048, tmp_path) is None
