"""Token windows (megamoe_rt/schedule/token_windows.py): a call run as calls over windows of its
tokens, property-tested on the CPU; the GPU suite checks the output is bit for bit the same."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.modes.base import Call
from megamoe_rt.schedule.token_windows import num_windows, token_windows


@settings(deadline=None)
@given(
    bound=st.integers(0, 20_000),
    window=st.integers(16, 8_192),
    ranks_tokens=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
)
def test_every_rank_runs_the_same_windows_and_each_covers_its_own_tokens_once(bound, window, ranks_tokens):
    per_rank = [token_windows(int(share * bound), bound, window) for share in ranks_tokens]
    # Collective: the same number of windows on every rank, from the agreed bound alone.
    assert {len(w) for w in per_rank} == {num_windows(bound, window)}
    for share, windows in zip(ranks_tokens, per_rank):
        tokens = int(share * bound)
        covered = []
        for c, w in enumerate(windows):
            assert 0 <= w.num_tokens <= window and w.num_tokens <= w.bound <= window
            if w.num_tokens:
                assert w.first == c * window  # window c holds tokens [c*W, ...)
            covered.extend(range(w.first, w.first + w.num_tokens))
        assert covered == list(range(tokens))  # each token once, in order
    # A window's bound is the same on every rank (it comes from the agreed bound).
    assert len({tuple(w.bound for w in windows) for windows in per_rank}) == 1
    assert sum(w.bound for w in per_rank[0]) == bound


def test_a_window_at_least_the_bound_is_the_call_itself():
    assert token_windows(300, 1000, 1000) == [(0, 300, 1000)]
    assert token_windows(0, 0, 64) == [(0, 0, 0)]  # an empty call is still one (collective) call


@pytest.mark.parametrize("idx, idx_bytes", [("int32", 4), ("int64", 8)])
def test_a_windowed_call_points_at_its_first_tokens_rows(idx, idx_bytes):
    h, k = 1024, 6
    call = Call(10_000, 20_000, 30_000, 40_000, 50_000, 900, idx, 1000, token_base=0)
    w = call.window(256, 256, 256, hidden=h, num_topk=k)
    assert w.x == call.x + 256 * h  # e4m3 rows
    assert w.x_sf == call.x_sf + 256 * (h // 128) * 4  # fp32 scales, [T, H/128]
    assert w.topk_idx == call.topk_idx + 256 * k * idx_bytes
    assert w.topk_weights == call.topk_weights + 256 * k * 4
    assert w.y == call.y + 256 * h * 2  # bf16 rows
    assert (w.num_tokens, w.bound, w.idx, w.token_base) == (256, 256, idx, 256)
    # Reports of a window's refused ids name the caller's tokens (MoeParams.token_base).
    assert w.window(10, 5, 5, hidden=h, num_topk=k).token_base == 266
