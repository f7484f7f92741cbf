"""A reported timeout record is reset, so the next timed-out wait can record (CPU: the record
lives in ordinary memory here instead of mapped pinned memory)."""

from __future__ import annotations

import pytest

from megamoe_rt.kernels.interface import sync as decl
from megamoe_rt.runtime import deadlines
from megamoe_rt.runtime.deadlines import TimeoutRecord


@pytest.fixture
def record(monkeypatch):
    inst = TimeoutRecord.__new__(TimeoutRecord)
    inst._fields = deadlines._RecordFields()
    monkeypatch.setattr(TimeoutRecord, "_instance", inst)
    TimeoutRecord.forget()
    yield inst._fields
    TimeoutRecord.forget()


def _complete(fields, site: str, seen: int):
    fields.site = decl.WAIT_SITE[site]
    fields.expected, fields.seen, fields.elapsed_ns = 5, seen, 2_000_000_000
    fields.state = decl.RECORD_COMPLETE.value


def test_nothing_recorded_explains_nothing(record):
    assert TimeoutRecord.pending_message() is None


def test_a_reported_record_is_reset_and_its_message_kept_for_the_same_fault(record):
    _complete(record, "kGridBarrier", 3)
    first = TimeoutRecord.pending_message()
    assert "wait 'grid barrier' timed out after 2.00 s" in first and "(generation 3)" in first
    assert "arrived as 0 of 5 blocks and the barrier never opened" in first
    assert record.state == decl.RECORD_EMPTY.value  # the slot is free for the next timeout
    assert TimeoutRecord.pending_message() == first  # the trapped context keeps failing alike


def test_a_new_timeout_after_the_report_is_the_one_explained(record):
    _complete(record, "kGridBarrier", 3)
    TimeoutRecord.pending_message()
    _complete(record, "kCombineArrived", 7)
    text = TimeoutRecord.pending_message()
    assert "combine partials from all peers" in text and "saw 7" in text


def test_forget_drops_the_message(record):
    _complete(record, "kGridBarrier", 3)
    TimeoutRecord.pending_message()
    TimeoutRecord.forget()
    assert TimeoutRecord.pending_message() is None
