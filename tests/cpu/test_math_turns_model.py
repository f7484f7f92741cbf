"""The math warpgroups' turn order (megamoe_rt/schedule/math_turns.py, the model of
gemm::MathTurns): under any interleaving the steps issue alternately, warpgroup 0 first, no
barrier completes without the warpgroup whose turn it is, and both barriers end balanced."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.schedule import math_turns


@settings(max_examples=300, deadline=None)
@given(steps=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_steps_alternate_from_warpgroup_0_under_any_interleaving(steps, seed):
    issued, left = math_turns.run(steps, random.Random(seed))
    assert issued == [0, 1] * steps
    assert left == [0, 0]  # warpgroup 0's last sync took warpgroup 1's extra arrival back


def test_without_warpgroup_1s_first_arrival_both_wait():
    with pytest.raises(math_turns.Deadlock):
        math_turns.run(3, random.Random(0), begin=False)


def test_without_the_last_sync_one_arrival_is_left_on_t0():
    for seed in range(50):
        issued, left = math_turns.run(5, random.Random(seed), end=False)
        assert issued == [0, 1] * 5 and left == [math_turns.WARPGROUP, 0]


def test_a_turn_passed_twice_is_caught():
    # Warpgroup 1 passing the turn twice per step would complete T0 by its arrivals alone.
    wg1 = math_turns.program(1, 3)
    wg1 = [op for o in wg1 for op in ([o, o] if o == ("arrive", 0) else [o])]
    with pytest.raises(math_turns.BarrierMisuse, match="T0 completed"):
        for seed in range(20):
            math_turns.run(3, random.Random(seed), programs=[math_turns.program(0, 3), wg1])
