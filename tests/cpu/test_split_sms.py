"""The split mode's SM counts, its tuning cache and the tune-split chart (no GPU)."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megamoe_rt.cli.png_chart import bar_chart_png
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


def _png_rows(data: bytes) -> tuple[int, int, list[bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = body
        pos += 12 + n
    w, h = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[r * (3 * w + 1) + 1 : (r + 1) * (3 * w + 1)] for r in range(h)]
    return w, h, rows


def test_the_chart_is_a_valid_png_with_bars_in_proportion():
    w, h, rows = _png_rows(bar_chart_png([100.0, 50.0, 25.0], highlight=1, reference=80.0))
    assert (w, h) == (20 + 3 * 36, 240)

    def bar_height(n: int) -> int:
        x = 10 + n * 36 + 10
        return sum(1 for r in rows if r[3 * x : 3 * x + 3] not in (b"\xff\xff\xff", b"\x00\x00\x00"))

    tall, mid, short = bar_height(0), bar_height(1), bar_height(2)
    assert tall == 220 and abs(mid - 110) <= 1 and abs(short - 55) <= 1
    with pytest.raises(ValueError):
        bar_chart_png([])
