"""Each fact in one place (CPU): one integer check for every scalar argument (runtime/args.py:
a bool where an int is expected is a TypeError everywhere), one check of the experts over the
ranks, the top-k and the 32-bit pool rows (schedule/plan.py) whose message is the same from the
layer, the layout and the planner, and the counter banks' offsets computed from the interface
declarations (kernels/interface/fused.py, ep.py) with the values the hand-written sums gave."""

from __future__ import annotations

import re
import traceback
from types import SimpleNamespace

import numpy as np
import pytest

from megamoe_rt import reference as ref
from megamoe_rt.ep import agreement
from megamoe_rt.ep.launch import RankContext, launch_script, spawn
from megamoe_rt.kernels import ep as ek
from megamoe_rt.kernels import fused as fk
from megamoe_rt.kernels.interface import decl
from megamoe_rt.kernels.interface import ep as ep_decl
from megamoe_rt.kernels.interface import fused as fused_decl
from megamoe_rt.layer import MegaMoE
from megamoe_rt.layer_calls import CallChecks
from megamoe_rt.runtime import devices, driver
from megamoe_rt.schedule import plan
from megamoe_rt.schedule.layout import check_channels, symm_buffer_layout
from megamoe_rt.schedule.split_sms import SplitSms, check_split_sms
from megamoe_rt.schedule.streaming import StreamConfig
from tests.helpers import ranks

# --- one integer check: a bool is a TypeError naming the argument -----------------------------

LAYOUT = dict(hidden=512, intermediate=256, num_experts=8, num_topk=2, num_max_tokens_per_rank=64, num_ranks=2)

# (what is called, its valid keyword arguments, {argument: the name its message gives}).
CALLS = [
    (plan.align_tokens, dict(n=5), {"n": "n"}),
    (
        plan.pool_blocks_upper_bound,
        dict(num_tokens_per_rank=64, num_ranks=2, num_topk=2, num_local_experts=4, block_m=64),
        None,
    ),
    (
        plan.estimated_units,
        dict(num_tokens_bound=64, num_ranks=2, num_topk=2, num_experts=8, num_local_experts=4, block_m=64),
        None,
    ),
    (plan.lag_units, dict(units=10), None),
    (plan.FusedSchedule, dict(lag_units=8, group_units=4, ring_blocks=50, full_pool_blocks=50), None),
    (plan.fused_schedule, dict(num_tokens_bound=64, num_ranks=2, num_topk=2, num_experts=8, block_m=64), None),
    (
        plan.single_wave_fits,
        dict(num_tokens_bound=64, num_ranks=2, num_topk=2, num_experts=8, ring_blocks=10, block_m=64),
        None,
    ),
    (plan.num_cycles, dict(total_pool_blocks=10, ring_blocks=3), None),
    (
        plan.cycles_to_launch,
        dict(num_tokens_bound=64, num_ranks=2, num_topk=2, num_local_experts=4, ring_blocks=3, block_m=64),
        {"num_tokens_bound": "num_tokens_bound", "ring_blocks": "ring_blocks"},
    ),
    (plan.check_expert_split, dict(num_experts=8, num_topk=2, num_ranks=2), None),
    (
        plan.max_tokens_per_rank,
        dict(num_ranks=2, num_topk=2, num_local_experts=4, block_m=64, max_rows=10**6),
        None,
    ),
    (
        plan.checked_pool_blocks,
        dict(num_tokens_per_rank=64, num_ranks=2, num_topk=2, num_local_experts=4, block_m=64),
        None,
    ),
    (symm_buffer_layout, dict(LAYOUT, block_m=64, act_sf_gran=64), None),
    (symm_buffer_layout, dict(LAYOUT, pool="ring", ring_blocks=4), {"ring_blocks": "ring_blocks"}),
    (symm_buffer_layout, dict(LAYOUT, pool="ring", num_tokens_bound=32), {"num_tokens_bound": "num_tokens_bound"}),
    (symm_buffer_layout, dict(LAYOUT, stream_slots=2, stream_tokens=32), {"stream_slots": "stream_slots"}),
    (symm_buffer_layout, dict(LAYOUT, stream_slots=2, stream_tokens=32), {"stream_tokens": "stream_tokens"}),
    (check_channels, dict(hidden=512, intermediate=256), None),
    (
        StreamConfig,
        dict(num_slots=2, tokens_per_slot=32),
        {n: f"StreamConfig.{n}" for n in ("num_slots", "tokens_per_slot")},
    ),
    (
        ref.random_moe_inputs,
        dict(rng=0, num_tokens=4, hidden=128, intermediate=128, num_experts=4, num_topk=2),
        {n: n for n in ("num_tokens", "hidden", "intermediate", "num_experts", "num_topk")},
    ),
    (ref.requant_rows, dict(act=np.ones((2, 128), np.float32), gran=64), {"gran": "gran"}),
    (
        ref.dequantize_act,
        dict(zip(("q", "sf"), ref.quantize_act_1x128(np.ones((2, 256), np.float32)))),
        {"gran": "gran"},
    ),
    (
        ref.moe_forward,
        dict(ref.random_moe_inputs(0, 4, 128, 128, 4, 2), act_sf_gran=128),
        {"act_sf_gran": "act_sf_gran"},
    ),
]


def _cases():
    for fn, good, names in CALLS:
        for arg, label in (names or {n: n for n in good}).items():
            yield pytest.param(fn, good, arg, label, id=f"{fn.__name__}-{arg}")


@pytest.mark.parametrize("fn, good, arg, label", list(_cases()))
def test_a_bool_is_a_type_error_naming_the_argument(fn, good, arg, label):
    fn(**good)  # the valid call goes through
    for flag in (True, np.bool_(False)):
        with pytest.raises(TypeError, match=f"^{re.escape(label)}: expected an integer, got the bool "):
            fn(**{**good, arg: flag})


def test_a_bool_among_the_cycle_counts_or_split_sms_is_a_type_error():
    with pytest.raises(TypeError, match=r"^per_rank_cycles\[1\]: expected an integer, got the bool True"):
        plan.num_cycles_across_ranks([2, True])
    for i, name in enumerate(("l1", "l2", "reduce")):
        sms = [88, 44, 132]
        sms[i] = True
        with pytest.raises(TypeError, match=f"^split_sms.{name}: expected an integer, got the bool True"):
            check_split_sms(tuple(sms), 132, 8)
        with pytest.raises(TypeError, match=f"^split_sms.{name}: expected an integer"):
            check_split_sms(SplitSms(*sms), 132, 8)
    # NumPy integers are integers, as everywhere else (they were refused here before).
    assert check_split_sms((np.int64(88), 44, 132), 132, 8) == SplitSms(88, 44, 132)


@pytest.mark.parametrize("name", ["hidden", "intermediate", "num_experts", "num_topk", "num_max_tokens_per_rank"])
def test_the_layer_refuses_a_bool_shape_count_before_any_gpu_work(name):
    shape = {"hidden": 512, "intermediate": 256, "num_experts": 8, "num_topk": 2, "num_max_tokens_per_rank": 64}
    with pytest.raises(TypeError, match=f"^{name}: expected an integer, got the bool True"):
        MegaMoE(**{**shape, name: True})


def test_the_layer_refuses_a_bool_token_bound():
    checks = CallChecks(hidden=512, num_topk=2, capacity=128, device=0)
    assert checks.bound(np.int32(64), 10) == 64
    with pytest.raises(TypeError, match="^num_tokens_bound: expected an integer, got the bool True"):
        checks.bound(True, 1)
    with pytest.raises(TypeError, match="^num_tokens_bound: expected an integer, got float 64.0"):
        checks.bound(64.0, 1)


def test_the_reference_refuses_bool_granularities():
    q, sf = ref.quantize_act_1x128(np.ones((2, 256), np.float32))
    qw, sw = ref.quantize_weight_128x128(np.ones((128, 256), np.float32))
    with pytest.raises(TypeError, match="^a_gran: expected an integer, got the bool True"):
        ref.fp8_block_gemm(q, sf, qw, sw, a_gran=True)
    with pytest.raises(ValueError, match="^a_gran: expected one of 64, 128, got 96"):
        ref.fp8_block_gemm(q, sf, qw, sw, a_gran=96)


def test_the_launchers_refuse_a_bool_rank_count_or_root():
    for call in (lambda: spawn(ranks.double_rank, True), lambda: launch_script(True, "x.py", [])):
        with pytest.raises(TypeError, match="^nprocs: expected an integer, got the bool True") as info:
            call()
        assert isinstance(info.value, ValueError)  # as launch_script raised for these before
    ctx = SimpleNamespace(world_size=2)
    with pytest.raises(TypeError, match="^root: expected an integer, got the bool True"):
        RankContext.broadcast(ctx, b"x", root=True)
    with pytest.raises(ValueError, match=r"root must be a rank in \[0, 2\), got 2"):
        RankContext.broadcast(ctx, b"x", root=2)


# --- one check of the experts over the ranks, the top-k and the pool rows --------------------


class _Group:
    """A two-rank group whose collectives are never reached (the agreement is stood in for)."""

    def __init__(self, rank=0, world_size=2, device=0):
        self.rank, self.world_size, self.device = rank, world_size, device

    def broadcast(self, value, *, key="default", root=0):
        raise AssertionError("no collective expected")

    barrier = allgather = broadcast


def _raised_by(call) -> tuple[str, str]:
    """The ValueError ``call`` raises: its message and the function that raised it."""
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value), traceback.extract_tb(info.value.__traceback__)[-1].name


@pytest.fixture
def agreement_raises(monkeypatch):
    """Across ranks the layer hands a failure to the agreement, which raises it on every rank;
    here it raises it at once."""

    def agree(group, settings, failure):
        if failure is not None:
            raise failure

    monkeypatch.setattr(agreement, "agree_on_construction", agree)


@pytest.mark.parametrize(
    "experts, topk, world, message",
    [
        (7, 2, 2, "num_experts=7: expected a multiple of num_ranks=2"),
        (12, 2, 8, "num_experts=12: expected a multiple of num_ranks=8"),
        (4, 5, 1, "num_topk=5: expected at most num_experts=4"),
        (8, 9, 2, "num_topk=9: expected at most num_experts=8"),
    ],
)
def test_the_layer_the_layout_and_the_planner_refuse_an_expert_split_with_one_message(
    experts, topk, world, message, agreement_raises
):
    group = _Group(world_size=world) if world > 1 else None
    raised = {
        "check": _raised_by(lambda: plan.check_expert_split(experts, topk, world)),
        "planner": _raised_by(lambda: plan.fused_schedule(64, world, topk, experts, 64)),
        "single wave": _raised_by(lambda: plan.single_wave_fits(64, world, topk, experts, 8, 64)),
        "layout": _raised_by(lambda: symm_buffer_layout(512, 256, experts, topk, 64, world)),
        "layer": _raised_by(lambda: MegaMoE(512, 256, experts, topk, 64, group=group)),
    }
    for where, (text, raiser) in raised.items():
        assert (text, raiser) == (message, "check_expert_split"), where


def test_the_layer_keeps_the_kernels_own_limits():
    with pytest.raises(ValueError, match=r"^num_topk=33: expected at most 32 \(the kernels' slot masks\)"):
        MegaMoE(512, 256, 64, 33, 64)


@pytest.mark.parametrize("ranks_, topk, local, block_m", [(1, 8, 8, 64), (8, 6, 32, 128), (2, 1, 1, 64)])
def test_the_pool_row_limit_is_one_check_with_one_message(ranks_, topk, local, block_m, monkeypatch):
    limit = plan.max_tokens_per_rank(ranks_, topk, local, block_m)
    assert limit > 0 and limit % plan.TOKEN_ALIGN == 0
    rows = plan.pool_blocks_upper_bound(limit, ranks_, topk, local, block_m) * block_m
    assert rows <= plan.MAX_POOL_ROWS  # the limit fits, one more token block does not
    over = plan.pool_blocks_upper_bound(limit + plan.TOKEN_ALIGN, ranks_, topk, local, block_m) * block_m
    assert over > plan.MAX_POOL_ROWS

    experts, t = ranks_ * local, limit + plan.TOKEN_ALIGN
    # The layer past its GPU check: on a CPU the device is stood in for, the layout refuses.
    monkeypatch.setattr(devices, "require_hopper", lambda device=None: SimpleNamespace(ordinal=0, sm_count=132))
    monkeypatch.setattr(driver, "ensure_context", lambda device: None)
    mode = "fused" if block_m == 64 else "unfused"
    raised = {
        "check": _raised_by(lambda: plan.checked_pool_blocks(t, ranks_, topk, local, block_m)),
        "planner": _raised_by(lambda: plan.fused_schedule(t, ranks_, topk, experts, block_m)),
        "layout": _raised_by(lambda: symm_buffer_layout(512, 256, experts, topk, t, ranks_, block_m=block_m)),
    }
    if ranks_ == 1:
        raised["layer"] = _raised_by(lambda: MegaMoE(512, 256, experts, topk, t, mode=mode))
    message = raised["check"][0]
    assert message.startswith(f"tokens per rank {t}: expected at most {limit} with num_ranks={ranks_}, ")
    assert "32-bit pool row indices" in message
    for where, (text, raiser) in raised.items():
        assert (text, raiser) == (message, "checked_pool_blocks"), where
    # At the limit the layout and the planner go through.
    symm_buffer_layout(512, 256, experts, topk, limit, ranks_, block_m=block_m)
    plan.fused_schedule(limit, ranks_, topk, experts, block_m)


# --- bank offsets from the declarations --------------------------------------------------------


def _old_fused_bank(el: int, b: int) -> dict[str, int]:
    """kernels/fused.py's bank_layout as it was written by hand."""
    return dict(
        words=2 * el + 3 * b + 4,
        counts=0,
        cursors=el,
        arrivals=2 * el,
        l1_done=2 * el + b,
        l2_read=2 * el + 2 * b,
        ticket=2 * el + 3 * b,
        l2_ticket=2 * el + 3 * b + 1,
        routing_published=2 * el + 3 * b + 2,
        reduce_exits=2 * el + 3 * b + 3,
    )


def _old_ep_bank(r: int, el: int) -> dict[str, int]:
    """kernels/ep.py's bank_layout as it was written by hand."""
    n = r * el
    return dict(
        words=2 * n + 2 * r + 1,
        recv_counts=0,
        recv_offsets=n,
        count_ready=2 * n,
        combine_ready=2 * n + r,
        pool_cycles=2 * n + 2 * r,
    )


def _values(struct) -> dict[str, int]:
    return {name: getattr(struct, name) for name, *_ in struct._fields_}


@pytest.mark.parametrize("experts", [1, 2, 8, 32, 48, 256, 384, 1024])
@pytest.mark.parametrize("blocks", [0, 1, 268, 3103, 1 << 16])
def test_the_fused_bank_offsets_are_what_the_hand_sums_were(experts, blocks):
    assert fused_decl.bank_offsets(experts, blocks) == _old_fused_bank(experts, blocks)
    assert _values(fk.bank_layout(experts, blocks)) == _old_fused_bank(experts, blocks)
    lay = symm_buffer_layout(512, 256, experts, 1, 64, 1)
    # What the buffer reserves per bank is the declared bank's words.
    rows = lay.workspace_region("fused_banks").shape[1]
    assert rows == fk.bank_layout(experts, lay.full_pool_blocks).words


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("local", [1, 3, 8, 32, 48])
def test_the_ep_bank_offsets_are_what_the_hand_sums_were(num_ranks, local):
    assert ep_decl.bank_offsets(num_ranks, local) == _old_ep_bank(num_ranks, local)
    assert _values(ek.bank_layout(num_ranks, local)) == _old_ep_bank(num_ranks, local)
    if num_ranks > 1:
        lay = symm_buffer_layout(512, 256, num_ranks * local, 1, 64, num_ranks)
        assert lay.workspace_region("ep_banks").shape[1] == ek.bank_layout(num_ranks, local).words


def test_region_lengths_must_name_every_region_in_field_order():
    lengths = fused_decl.bank_region_words(4, 10)
    assert list(lengths) == [f.name for f in fused_decl.BANK_LAYOUT.fields][1:]
    assert list(ep_decl.bank_region_words(2, 4)) == [f.name for f in ep_decl.EP_BANK_LAYOUT.fields][1:]
    missing = dict(lengths)
    del missing["l2_read"]
    with pytest.raises(ValueError, match="lengths: expected the regions of BankLayout in field order"):
        decl.packed_offsets(fused_decl.BANK_LAYOUT, missing)
    swapped = {"cursors": 4, "counts": 4, **{k: v for k, v in lengths.items() if k not in ("counts", "cursors")}}
    with pytest.raises(ValueError, match="in field order"):
        decl.packed_offsets(fused_decl.BANK_LAYOUT, swapped)
