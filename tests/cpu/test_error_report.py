"""Decoding of the kernels' error reports (cuda_src/common/error_report.cuh) and the messages
the layer raises from them."""

from __future__ import annotations

import re

import pytest

from megamoe_rt.kernels.interface import errors as decl
from megamoe_rt.layer import describe_findings
from megamoe_rt.runtime.error_report import ERROR_KINDS, decode
from megamoe_rt.runtime.errors import DeviceInputError, Finding

RAISED = 1 << 63


def _word(where: int, what: int) -> int:
    # What report_error stores: the flag, `where` in bits 62..32, `what` in bits 31..0.
    return RAISED | (where & 0x7FFFFFFF) << 32 | (what & 0xFFFFFFFF)


def test_kinds_follow_the_declaration():
    assert tuple(v.key for v in decl.ERROR_KIND.values) == ERROR_KINDS
    assert len(decl.ERROR_REPORT.ctype().words) == len(ERROR_KINDS)


def test_empty_words_decode_to_nothing():
    assert decode([0] * len(ERROR_KINDS)) == ()


def test_words_decode_to_their_kind_and_details():
    words = [0] * len(ERROR_KINDS)
    words[ERROR_KINDS.index("repeated_expert_id")] = _word(41, 7)
    words[ERROR_KINDS.index("expert_id_out_of_range")] = _word(0x7FFFFFFF, -5)
    found = decode(words)
    assert [f.kind for f in found] == ["expert_id_out_of_range", "repeated_expert_id"]
    assert found[0].where == 0x7FFFFFFF and found[0].what_signed == -5
    assert found[1] == Finding("repeated_expert_id", 41, 7)


def test_a_word_without_the_raised_bit_is_not_a_finding():
    words = [0] * len(ERROR_KINDS)
    words[0] = 12345  # details but no flag: never written by report_error
    assert decode(words) == ()


@pytest.mark.parametrize(
    "finding, expect",
    [
        (Finding("expert_id_out_of_range", 3 * 4 + 1, 64), r"outside \[-1, 64\) \(e.g. topk_idx\[3, 1\] = 64\)"),
        (Finding("expert_id_out_of_range", 0, (1 << 32) - 7), r"topk_idx\[0, 0\] = -7"),
        (Finding("repeated_expert_id", 5 * 4 + 2, 9), r"topk_idx\[5, 2\] = 9 repeats an earlier slot of token 5"),
        (Finding("pool_overflow", 900, 640), r"needs 900 rows of the expert pool, the buffer holds 640"),
    ],
)
def test_messages_name_the_argument_and_the_entry(finding, expect):
    text = describe_findings((finding,), num_topk=4, num_experts=64, rank=None)
    assert text.startswith("MegaMoE: inputs refused on the device")
    assert re.search(expect, text), text


def test_messages_across_ranks_name_the_rank():
    text = describe_findings((Finding("pool_overflow", 1, 1),), num_topk=2, num_experts=8, rank=3)
    assert text.startswith("MegaMoE (rank 3):")


def test_device_input_error_is_a_value_error_carrying_the_findings():
    f = (Finding("repeated_expert_id", 1, 2),)
    err = DeviceInputError("x", f)
    assert isinstance(err, ValueError) and err.findings == f
