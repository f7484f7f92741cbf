"""Arguments refused before any work, a TypeError for the wrong type and a ValueError out of
range, each naming the argument, its value and what was expected: rank groups, the router's
counts, the buffer layout's integers (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from megamoe_rt.ep.group import check_group
from megamoe_rt.schedule.layout import symm_buffer_layout


class _Group:
    """A rank group whose collectives must not be reached."""

    def __init__(self, rank, world_size, device=0):
        self.rank, self.world_size, self.device = rank, world_size, device

    def broadcast(self, value, *, key="default", root=0):
        raise AssertionError("no collective expected")

    barrier = allgather = broadcast


BAD_GROUPS = [
    (_Group(0, 0), ValueError, "group.world_size=0: expected an integer >= 1"),
    (_Group(5, 2), ValueError, "group.rank=5: expected 0 <= rank < group.world_size=2"),
    (_Group(-1, 2), ValueError, "group.rank=-1: expected 0 <= rank < group.world_size=2"),
    (_Group(0, True), TypeError, "group.world_size: expected an integer, got the bool True"),
    (_Group(False, 2), TypeError, "group.rank: expected an integer, got the bool False"),
    (_Group(0, 2.0), TypeError, "group.world_size: expected an integer, got float 2.0"),
    (_Group(1.0, 2), TypeError, "group.rank: expected an integer, got float 1.0"),
]


@pytest.mark.parametrize("group, error, words", BAD_GROUPS)
def test_a_group_that_cannot_be_one_is_refused(group, error, words):
    with pytest.raises(error) as info:
        check_group(group)
    assert words in str(info.value)


@pytest.mark.parametrize("group, error, words", BAD_GROUPS)
def test_the_layer_refuses_such_a_group_before_any_exchange_not_with_a_zero_division(group, error, words):
    from megamoe_rt import MegaMoE

    with pytest.raises(error) as info:
        MegaMoE(512, 256, 8, 2, 64, group=group)
    assert words in str(info.value)


@pytest.mark.parametrize("group, error, words", BAD_GROUPS[:4])
def test_nvshmem_refuses_such_a_group_before_starting(group, error, words):
    from megamoe_rt.ep.symm import NvshmemRuntime

    with pytest.raises(error) as info:
        NvshmemRuntime(group)
    assert words.replace("group.", "ctx.") in str(info.value)


def test_a_group_and_numpy_ints_pass():
    assert check_group(_Group(np.int64(1), np.int32(2))) == (1, 2)
    with pytest.raises(TypeError, match="group: expected a RankGroup"):
        check_group(object())


@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({"hidden": 512.0}, TypeError, "hidden: expected an integer, got float 512.0"),
        ({"num_experts": True}, TypeError, "num_experts: expected an integer, got the bool True"),
        ({"num_topk": 0}, ValueError, "num_topk=0: expected an integer >= 1"),
        ({"num_max_tokens_per_rank": 64.5}, TypeError, "num_max_tokens_per_rank: expected an integer"),
    ],
)
def test_layer_shape_counts_must_be_ints(kw, error, words):
    from megamoe_rt import MegaMoE

    shape = {"hidden": 512, "intermediate": 256, "num_experts": 8, "num_topk": 2, "num_max_tokens_per_rank": 64}
    shape.update(kw)
    with pytest.raises(error) as info:
        MegaMoE(*shape.values())
    assert words in str(info.value)


@pytest.mark.parametrize(
    "experts, topk, error, words",
    [
        (2.0, 1.5, TypeError, "num_experts: expected an integer, got float 2.0"),
        (2, 1.5, TypeError, "num_topk: expected an integer, got float 1.5"),
        (True, 1, TypeError, "num_experts: expected an integer, got the bool True"),
        ("16", 2, TypeError, "num_experts: expected an integer, got str '16'"),
        (0, 1, ValueError, "num_experts=0: expected 1..1024"),
        (16, 17, ValueError, "num_topk=17: expected 1..num_experts=16"),
    ],
)
def test_router_counts_are_checked_before_cupy_or_a_compile(experts, topk, error, words, monkeypatch):
    import sys

    from megamoe_rt.routers import Router

    monkeypatch.setitem(sys.modules, "cupy", None)  # an import of CuPy would raise ImportError
    with pytest.raises(error) as info:
        Router(experts, topk)
    assert words in str(info.value)


def test_a_router_for_a_layer_matches_its_counts_and_needs_its_input_ring(monkeypatch):
    import sys
    from types import SimpleNamespace

    from megamoe_rt.routers import Router

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ValueError, match="layer: expected a layer built with streaming="):
        Router(16, 2, SimpleNamespace(streaming=None, num_experts=16, num_topk=2))
    streamed = SimpleNamespace(streaming=object(), num_experts=16, num_topk=4)
    with pytest.raises(ValueError, match=r"num_topk=2: expected the layer's num_topk=4"):
        Router(16, 2, streamed)


LAYOUT = dict(hidden=4096, intermediate=2048, num_experts=256, num_topk=6, num_max_tokens_per_rank=8192, num_ranks=8)


@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({"act_sf_gran": 128.0}, TypeError, "act_sf_gran: expected an integer, got float 128.0"),
        ({"act_sf_gran": True}, TypeError, "act_sf_gran: expected an integer, got the bool True"),
        ({"block_m": 64.0}, TypeError, "block_m: expected an integer, got float 64.0"),
        ({"hidden": 4096.0}, TypeError, "hidden: expected an integer, got float 4096.0"),
        ({"num_ranks": True}, TypeError, "num_ranks: expected an integer, got the bool True"),
        ({"stream_slots": 1.5, "stream_tokens": 128}, TypeError, "stream_slots: expected an integer"),
        ({"stream_slots": 2, "stream_tokens": 128.0}, TypeError, "stream_tokens: expected an integer"),
        ({"stream_slots": 2, "stream_tokens": 0}, ValueError, "stream_tokens=0: expected an integer >= 1"),
        ({"pool": "ring", "ring_blocks": 64.0}, TypeError, "ring_blocks: expected an integer"),
        ({"block_m": 96}, ValueError, "block_m: expected one of 64, 128, got 96"),
    ],
)
def test_layout_integers_must_be_ints(kw, error, words):
    with pytest.raises(error) as info:
        symm_buffer_layout(**{**LAYOUT, **kw})
    assert words in str(info.value)


def test_layout_sizes_are_ints_whatever_int_type_the_counts_came_as():
    lay = symm_buffer_layout(**{**LAYOUT, "act_sf_gran": np.int64(64), "block_m": np.int32(128)})
    assert type(lay.act_sf_gran) is int and type(lay.block_m) is int and type(lay.total_bytes) is int
    assert all(type(r.offset) is int and type(r.nbytes) is int for r in lay.regions)
