"""Every setting of a layer agreed across ranks, and a failure on one rank while constructing or
allocating raised on every rank (megamoe_rt/ep/agreement.py, megamoe_rt/layer.py,
megamoe_rt/ep/symm.py). On the CPU: real rank processes (spawn) over the launcher's group, the
GPU, NVSHMEM and CuPy stood in for (tests/helpers/agreement_ranks.py)."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields
from types import SimpleNamespace

import pytest

from megamoe_rt.ep import agreement
from megamoe_rt.ep.launch import RankFailed, spawn
from megamoe_rt.layer import (
    AGREED_LAYER_SETTINGS,
    RANK_LOCAL_PARAMETERS,
    RANK_LOCAL_SPEC_FIELDS,
    MegaMoE,
    agreed_settings,
)
from megamoe_rt.modes.base import LayerSpec
from megamoe_rt.schedule.streaming import StreamConfig
from tests.helpers import agreement_ranks

# One case per agreed constructor parameter: (name, rank 0's value, rank 1's value).
DIFFERING = [
    ("hidden", 512, 1024),
    ("intermediate", 256, 512),
    ("num_experts", 8, 16),
    ("num_topk", 2, 4),
    ("num_max_tokens_per_rank", 64, 128),
    ("swiglu_limit", "<default>", 7.0),
    ("act_sf_gran", 128, 64),
    ("pow2_scale", "<default>", True),
    ("validate_ids", "<default>", False),
    ("debug", "<default>", True),
    ("mode", "<default>", "unfused"),
    ("ring_blocks", "<default>", 8),
    ("chunk_ratio", "<default>", 0.5),
    ("timeout_s", "<default>", 5.0),
    ("streaming", "<default>", StreamConfig(2, 32)),
    ("transport", "<default>", "nvlink"),
    ("token_window", "<default>", 32),
]
DEFAULTS = {"swiglu_limit": None, "pow2_scale": False, "validate_ids": True, "debug": False, "mode": None}
DEFAULTS.update(ring_blocks=None, chunk_ratio=None, timeout_s=None, streaming=None, transport="auto", token_window=None)


def _constructor_parameters() -> list[str]:
    return [p for p in inspect.signature(MegaMoE.__init__).parameters if p != "self"]


def _agreed_names() -> set[str]:
    spec = LayerSpec(*agreement_ranks.SHAPE)
    return set(agreed_settings(spec, **dict.fromkeys(AGREED_LAYER_SETTINGS)))


def test_every_constructor_parameter_is_agreed_or_rank_local_with_a_reason():
    """A new parameter of MegaMoE fails here until it is agreed (a LayerSpec field, or in
    AGREED_LAYER_SETTINGS) or listed as rank-local with its reason."""
    agreed = _agreed_names()
    for name in _constructor_parameters():
        local = name in RANK_LOCAL_PARAMETERS
        assert (name in agreed) != local, f"{name}: expected agreed across ranks or rank-local (with a reason)"
        if local:
            assert len(RANK_LOCAL_PARAMETERS[name]) > 20, f"{name}: say why it is rank-local"
    for name in RANK_LOCAL_PARAMETERS:
        assert name in _constructor_parameters(), f"{name}: listed as rank-local but not a parameter"


def test_every_layer_spec_field_is_agreed_unless_listed_rank_local():
    agreed = _agreed_names()
    for f in fields(LayerSpec):
        assert (f.name in agreed) != (f.name in RANK_LOCAL_SPEC_FIELDS), f.name
    # The numerics settings that once went unchecked across ranks.
    assert {"swiglu_limit", "pow2_scale", "act_sf_gran", "timeout_s", "num_ranks"} <= agreed


def test_every_agreed_parameter_has_a_differing_case_below():
    agreed_params = set(_constructor_parameters()) - set(RANK_LOCAL_PARAMETERS)
    assert {name for name, _, _ in DIFFERING} == agreed_params


def test_ranks_differing_in_any_one_setting_all_raise_the_same_value_error():
    cases = [*DIFFERING, ("debug", "<default>", "<default>")]  # the last: alike on both ranks
    per_rank = spawn(agreement_ranks.construct_with_each_setting_differing, 2, args=(cases,))
    for i, (name, mine, theirs) in enumerate(DIFFERING):
        seen = [per_rank[r][i] for r in range(2)]
        assert seen[0] == seen[1], (name, seen)  # the same error on every rank
        kind, text = seen[0]
        assert kind == "ValueError" and "the ranks construct different layers" in text, (name, text)
        values = [DEFAULTS[name] if v == "<default>" else v for v in (mine, theirs)]
        assert f"{name} (rank 0: {values[0]!r}, rank 1: {values[1]!r})" in text, (name, text)
    # Alike: past the agreement, to the GPU check (which fails on every CPU rank, agreed too).
    alike = [per_rank[r][-1] for r in range(2)]
    assert alike[0] == alike[1] and alike[0][0] == "RuntimeError", alike
    assert "the ranks' GPUs" in alike[0][1] and "failed on rank 0 (and 1 more rank(s))" in alike[0][1]


@pytest.mark.parametrize(
    "name, value, kind, words",
    [
        ("act_sf_gran", 96, "ValueError", "act_sf_gran: expected one of 64, 128, got 96"),
        ("swiglu_limit", "3", "TypeError", "swiglu_limit: expected a real number"),
        ("ring_blocks", 0, "ValueError", "ring_blocks=0: expected an integer >= 1"),
    ],
)
def test_a_bad_argument_on_one_rank_is_raised_on_every_rank(name, value, kind, words):
    out = spawn(agreement_ranks.one_rank_passes_a_bad_argument, 2, args=(name, value))
    assert out[0] == out[1], out
    got_kind, text = out[0]
    assert got_kind == kind and "MegaMoE construction: failed on rank 1" in text and words in text, text


def test_a_rank_without_a_usable_gpu_stops_every_rank_before_nvshmem_starts():
    out = spawn(agreement_ranks.one_rank_has_no_gpu, 2)
    (outcomes, started) = zip(*out)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "RuntimeError", outcomes
    assert "failed on rank 1" in outcomes[0][1] and "compute capability 8.0" in outcomes[0][1]
    assert started == ([], [])  # no rank entered NVSHMEM's start-up


def test_a_layout_failing_on_one_rank_stops_every_rank_before_the_allocation():
    out = spawn(agreement_ranks.one_rank_fails_its_layout, 2)
    (outcomes, started) = zip(*out)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "MemoryError", outcomes
    assert "the mode and the buffer's layout" in outcomes[0][1] and "rank 1: MemoryError: free device" in outcomes[0][1]
    assert started == ([], [])


# --- the symmetric buffer --------------------------------------------------------------------


def test_a_heap_exhausted_on_one_rank_raises_on_every_rank_and_stops_later_allocations():
    out = spawn(agreement_ranks.allocate_with_a_heap_exhausted_on, 2, args=([1], True))
    errors = [e for e, _, _ in out]
    assert errors[0] == errors[1], errors
    first, second = errors[0]
    assert first[0] == "MemoryError" and "nvshmem_malloc of" in first[1] and "failed on rank 1" in first[1]
    assert "the symmetric heap is exhausted" in first[1]
    # Rank 0 holds memory rank 1 lacks: no free (collective, unmatched), and no rank allocates again.
    assert second[0] == "RuntimeError" and "out of step across ranks" in second[1]
    for _, log, out_of_step in out:
        assert [op for op, _ in log] == ["malloc"] and out_of_step


def test_a_heap_exhausted_on_every_rank_leaves_the_heaps_in_step():
    out = spawn(agreement_ranks.allocate_with_a_heap_exhausted_on, 2, args=([0, 1],))
    assert out[0][0] == out[1][0] and "failed on rank 0 (and 1 more rank(s))" in out[0][0][0][1]
    assert all(out_of_step is None for _, _, out_of_step in out)


def test_buffers_laid_out_differently_are_refused_before_any_rank_allocates():
    out = spawn(agreement_ranks.allocate_with_layouts, 2, args=([64, 256],))
    (outcomes, logs) = zip(*out)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ValueError", outcomes
    assert "layout.num_max_tokens_per_rank (rank 0: 128, rank 1: 256)" in outcomes[0][1]
    assert logs == ([], [])


def test_a_layout_for_another_rank_count_on_one_rank_is_refused_on_every_rank():
    out = spawn(agreement_ranks.allocate_with_layouts, 2, args=([64, 64], [2, 1]))
    (outcomes, logs) = zip(*out)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ValueError", outcomes
    assert "failed on rank 1" in outcomes[0][1] and "computed for 1 ranks, the runtime has 2" in outcomes[0][1]
    assert logs == ([], [])


def test_a_close_failing_on_one_rank_frees_on_no_rank_and_raises_on_every_rank():
    out = spawn(agreement_ranks.close_with_a_failed_wait_on, 2, args=(1,))
    outcomes = [o for o, _, _ in out]
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "RuntimeError", outcomes
    assert "nvshmem_free (a symmetric buffer) (entered by no rank)" in outcomes[0][1]
    assert "rank 1: RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS" in outcomes[0][1]
    for _, log, registered in out:
        assert [op for op, _ in log] == ["malloc"] and registered == []  # never freed, given up


def test_a_peer_that_left_is_noticed_before_nvshmem_free_not_waited_for_inside_it():
    with pytest.raises(RankFailed, match=r"rank 0 failed: .*nvshmem_free .*did not all meet.*rank 1 ended"):
        spawn(agreement_ranks.free_after_the_peer_left, 2, timeout=120)


# --- NVSHMEM start-up ----------------------------------------------------------------------------


def test_nvshmem_starts_maps_and_finalizes_with_a_meeting_before_each_collective():
    out = spawn(agreement_ranks.start_nvshmem, 2)
    for outcome, log in out:
        assert outcome == (None, True) and log == ["init", "malloc", "free", "finalize"]


def test_heaps_sized_differently_are_refused_before_nvshmem_init():
    out = spawn(agreement_ranks.start_nvshmem, 2, args=(["1g", "2g"],))
    (outcomes, logs) = zip(*out)
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ValueError", outcomes
    assert "NVSHMEM_SYMMETRIC_SIZE (rank 0: '1g', rank 1: '2g')" in outcomes[0][1]
    assert logs == ([], [])


def test_a_rank_that_cannot_take_its_gpu_stops_every_rank_before_nvshmem_init():
    out = spawn(agreement_ranks.start_nvshmem, 2, args=(None, 1))
    (outcomes, logs) = zip(*out)
    assert outcomes[0] == outcomes[1] and "NVSHMEM start-up (entered by no rank)" in outcomes[0][1]
    assert "rank 1: RuntimeError: CUDA_ERROR_NO_DEVICE" in outcomes[0][1]
    assert logs == ([], [])


def test_rank_zero_without_a_unique_id_stops_every_rank_before_nvshmem_init():
    out = spawn(agreement_ranks.start_nvshmem, 2, args=(None, None, True))
    (outcomes, logs) = zip(*out)
    assert outcomes[0] == outcomes[1] and "nvshmem_init (entered by no rank)" in outcomes[0][1]
    assert "failed on rank 0 (and 1 more rank(s))" in outcomes[0][1]
    assert "no interface to listen on" in outcomes[0][1] and "rank 0 handed out no unique id" in outcomes[0][1]
    assert logs == ([], [])


# --- the pieces, without processes ------------------------------------------------------------------


class _Views:
    """Each rank's view of one exchange: allgather returns what every rank posted (computed
    by running the same function for every rank first)."""

    def __init__(self, posted):
        self.posted = posted

    def allgather(self, value, *, key):
        return self.posted


def _everyone(fn_by_rank):
    """Run ``fn(group)`` as every rank, each seeing all ranks' posts; return each outcome."""
    posts = []

    class Recorder:
        def allgather(self, value, *, key):
            posts.append(value)
            raise _Posted

    for fn in fn_by_rank:
        with pytest.raises(_Posted):
            fn(Recorder())
    outcomes = []
    for fn in fn_by_rank:
        try:
            fn(_Views(posts))
            outcomes.append(None)
        except Exception as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


class _Posted(BaseException):  # not an Exception: the code under test must not take it for a failure
    pass


def test_enter_together_names_the_failing_rank_and_its_error_the_same_on_every_rank():
    oom = MemoryError("the symmetric heap is exhausted")
    outcomes = _everyone(
        [
            lambda g: agreement.enter_together(g, "nvshmem_malloc (x)"),
            lambda g: agreement.enter_together(g, "nvshmem_malloc (x)", oom),
        ]
    )
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "MemoryError"
    assert "nvshmem_malloc (x) (entered by no rank): failed on rank 1" in outcomes[0][1]
    assert "rank 1: MemoryError: the symmetric heap is exhausted" in outcomes[0][1]


def test_enter_together_with_every_rank_able_raises_nothing():
    assert _everyone([lambda g: agreement.enter_together(g, "nvshmem_free (x)")] * 3) == [None] * 3


def test_a_meeting_that_times_out_names_the_collective():
    def allgather(value, *, key):
        assert key == "before nvshmem_finalize"
        raise TimeoutError("rank 0: exchange 'before nvshmem_finalize' #9: rank 1 did not take part within 600 s")

    with pytest.raises(TimeoutError, match=r"before nvshmem_finalize: the ranks did not all meet \(.*rank 1 did not"):
        agreement.enter_together(SimpleNamespace(allgather=allgather), "nvshmem_finalize")


def test_a_long_or_unusual_error_still_fits_one_slot_of_the_exchange():
    text = "\u00e9\x01" * 5000
    raw = agreement._post_with_error(ValueError(text), "")
    assert len(raw) <= 2048 and json.loads(raw)[0] == "ValueError"


def test_differences_name_each_setting_with_every_rank_s_value():
    texts = [agreement.settings_text({"a": 1, "b": None}), agreement.settings_text({"a": 1, "b": 7.0})]
    assert agreement.describe_differences(texts) == "b (rank 0: None, rank 1: 7.0)"
    assert agreement.settings_digest(texts[0]) != agreement.settings_digest(texts[1])
