"""Host side of the fused mode: schedules per call, shared-memory sizing, parameter mirrors (CPU)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.kernels import fused as fk
from megamoe_rt.modes.fused import BLOCK_M, FusedSchedules, buffer_schedule, call_schedule
from megamoe_rt.presets import get_preset
from megamoe_rt.schedule.layout import symm_buffer_layout
from megamoe_rt.schedule.plan import live_blocks_upper_bound, pool_blocks_upper_bound
from megamoe_rt.schedule.task_order import check_order, lag_task_order


def _layout(h=4096, i=2048, e=32, k=6, cap=8192, ring=None):
    return symm_buffer_layout(h, i, e, k, cap, 1, block_m=BLOCK_M, pool="ring", ring_blocks=ring)


def test_flash_slice_schedule_at_capacity():
    lay = _layout()
    s = buffer_schedule(lay)
    # 8192 x 6 / 32 = 1536 rows = 24 blocks = 3 units per expert, 96 units: lag round(43.2) = 43.
    assert (s.lag_units, s.group_units) == (43, 4)
    assert s.ring_blocks == lay.pool_blocks == 8 * (43 + 4) + 4 == 380
    assert s.full_pool_blocks == pool_blocks_upper_bound(8192, 1, 6, 32, BLOCK_M) == 799
    c = call_schedule(lay, s, 8192)
    assert not c.single_wave and c.lag_units == 43


def test_small_bounds_run_single_wave_and_mid_bounds_a_shorter_lag():
    lay = _layout()
    s = buffer_schedule(lay)
    small = call_schedule(lay, s, 2048)  # worst case (2048*6 + 32*63)/64 = 223 blocks <= 380
    assert small.single_wave and small.lag_units >= s.full_pool_blocks
    mid = call_schedule(lay, s, 4096)  # 415 blocks > 380: lag order, lag from the bound
    # 4096 x 6 / 32 = 768 rows = 12 blocks = 2 units per expert, 64 units: round(28.8) = 29.
    assert not mid.single_wave and mid.lag_units == 29 < s.lag_units


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 8192), frac=st.floats(0.0, 1.0), e=st.sampled_from([1, 4, 16, 32, 48]), k=st.integers(1, 8))
def test_every_call_schedule_fits_the_buffer_ring(cap, frac, e, k):
    k = min(k, e)
    lay = symm_buffer_layout(512, 256, e, k, cap, 1, block_m=BLOCK_M, pool="ring")
    schedules = FusedSchedules(lay)  # what a fused layer derives: the buffer's once, a call's per bound
    s = schedules.buffer
    assert s == buffer_schedule(lay)
    bound = max(1, int(frac * lay.num_max_tokens_per_rank))
    c = schedules.for_bound(bound)
    assert c == call_schedule(lay, s, bound) and schedules.for_bound(bound) is c
    if c.single_wave:
        assert pool_blocks_upper_bound(bound, 1, k, e, BLOCK_M) <= s.ring_blocks
    else:
        # The live window of the call's lag fits the ring (or the ring is the whole pool).
        call = type(s)(c.lag_units, c.group_units, s.ring_blocks, s.full_pool_blocks)
        assert s.covers_full_pool or s.ring_blocks >= live_blocks_upper_bound(call)


def test_a_ring_below_the_live_window_is_refused():
    with pytest.raises(ValueError, match="live"):
        buffer_schedule(_layout(ring=100))
    # A ring as large as the worst case never wraps and is always accepted.
    full = buffer_schedule(_layout()).full_pool_blocks
    assert buffer_schedule(_layout(ring=full)).covers_full_pool


@pytest.mark.parametrize("name", ["flash", "pro", "v3"])
def test_presets_fit_shared_memory_with_deep_pipelines(name):
    p = get_preset(name)
    for ranks in (1, 8):
        el = p.num_experts // 8
        blocks = pool_blocks_upper_bound(8192, ranks, p.num_topk, el, BLOCK_M)
        assert blocks <= fk.MAX_BLOCKS
        stages = fk.pick_stages(el)
        assert stages >= 4
        assert fk.dynamic_smem_bytes(stages, el) <= fk.SMEM_LIMIT
        assert stages in {
            int(s.name.split("[s")[1].split(",")[0]) for s in fk.kernel_specs() if s.name.startswith("fused_moe")
        }


def test_bank_layout_matches_the_workspace_region():
    lay = _layout()
    blocks = buffer_schedule(lay).full_pool_blocks
    bank = fk.bank_layout(lay.num_local_experts, blocks)
    region = lay.workspace_region("fused_banks")
    assert region.shape == (2, bank.words)
    assert bank.l2_read + blocks == bank.ticket
    # The ticket and the split pipeline's words close the bank, one word each, all distinct.
    tail = [bank.ticket, bank.l2_ticket, bank.routing_published, bank.reduce_exits]
    assert tail == list(range(bank.words - 4, bank.words))


def test_ring_task_order_of_a_skewed_call_is_safe_at_tile_level():
    lay = _layout(cap=4096)
    s = buffer_schedule(lay)
    counts = [4096 * 6 // 2, 4096 * 6 // 2] + [0] * 30  # everything on two experts
    blocks = [-(-c // BLOCK_M) for c in counts]
    c = call_schedule(lay, s, 4096)
    if not c.single_wave:
        check_order(lag_task_order(blocks, c.lag_units, c.group_units), s.ring_blocks)


@pytest.mark.parametrize("name", ["flash", "pro", "v3"])
@pytest.mark.parametrize("tokens", [32768, 65536, 131072])
def test_long_prefill_at_ep8_fits_shared_memory_whatever_the_pool(name, tokens):
    # The routing tables are sized by the local experts: a larger pool grows only global memory.
    p = get_preset(name)
    el = p.num_experts // 8
    blocks = pool_blocks_upper_bound(tokens, 8, p.num_topk, el, BLOCK_M)
    assert blocks <= fk.MAX_BLOCKS
    extra = fk.ep_scratch_bytes(p.num_experts, el, 8)
    stages = fk.pick_stages(el, extra)
    assert stages >= 4 and fk.dynamic_smem_bytes(stages, el, extra) <= fk.SMEM_LIMIT
    # scalars, row_begin, row_end, unit_begin; tile queue and relay: no term in the pool's size
    assert fk.table_bytes(el) == 16 + 4 * (el + 1) + 4 * el + 4 * (el + 1) + fk.TILE_QUEUE_BYTES + fk.RELAY_BYTES
