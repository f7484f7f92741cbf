"""Symmetric buffer layout: invariants over random shapes and hand-computed sizes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe_rt.presets import get_preset
from megamoe_rt.schedule.layout import BufferLayout, symm_buffer_layout
from megamoe_rt.schedule.plan import fused_schedule, pool_blocks_upper_bound

# Independent of the module's own table on purpose.
DTYPE_BYTES = {"e4m3": 1, "uint8": 1, "bf16": 2, "int32": 4, "uint32": 4, "float32": 4, "uint64": 8}

# x and x_sf (inputs staged for peers) and send_list exist across ranks only.
TOP_LEVEL = [
    "x",
    "x_sf",
    "l1_pool",
    "l1_pool_sf",
    "l1_pool_src",
    "l1_pool_weight",
    "l1_pool_dst",
    "l2_pool",
    "l2_pool_sf",
    "combine",
    "workspace",
]
EP_ONLY = ("x", "x_sf", "send_list")

MiB = 2**20


def up(n: int, a: int = 1024) -> int:
    return -(-n // a) * a


EP_WORKSPACE = [
    "ep_send_counts",
    "ep_send_offsets",
    "ep_send_cursors",
    "ep_src_rows",
    "ep_expert_totals",
    "ep_banks",
    "peer_bases",
]


def check_invariants(lay: BufferLayout) -> None:
    multi = lay.num_ranks > 1
    expected = TOP_LEVEL[:-1] + ["send_list", "workspace"]
    assert [r.name for r in lay.regions] == [n for n in expected if multi or n not in EP_ONLY]
    prev_end = 0
    for r in lay.regions:
        assert r.offset % 1024 == 0, r
        assert r.offset >= prev_end, f"{r.name} overlaps the previous region"
        assert r.end == r.offset + r.nbytes
        assert r.nbytes == math.prod(r.shape) * DTYPE_BYTES[r.dtype], r
        prev_end = r.end
    assert lay.total_bytes % 1024 == 0
    assert lay.total_bytes >= prev_end
    assert lay.total_bytes >= sum(r.nbytes for r in lay.regions)
    assert lay.offsets() == {r.name: r.offset for r in lay.regions}

    ws = lay.region("workspace")
    assert ws.nbytes % 1024 == 0
    prev_end = 0
    for w in lay.workspace:
        assert w.offset % 128 == 0, w
        assert w.offset >= prev_end, f"{w.name} overlaps the previous sub-region"
        assert w.nbytes == math.prod(w.shape) * DTYPE_BYTES[w.dtype], w
        prev_end = w.end
    assert prev_end <= ws.nbytes
    assert lay.workspace_offsets() == {w.name: w.offset for w in lay.workspace}
    names = [w.name for w in lay.workspace]
    assert all((n in names) == multi for n in EP_WORKSPACE)
    if multi:
        assert lay.region("send_list").shape == (lay.num_max_tokens_per_rank * lay.num_topk,)

    # TMA: 16-byte aligned bases and 16-byte multiple row strides (x_sf is read by the
    # dispatch, a token's row at a time, not by TMA).
    for r in lay.regions:
        if r.dtype == "e4m3" or (r.name.endswith("_sf") and r.name != "x_sf"):
            row_bytes = math.prod(r.shape[1:]) * DTYPE_BYTES[r.dtype]
            assert row_bytes % 16 == 0, r

    assert lay.pool_rows == lay.pool_blocks * lay.block_m
    T = lay.num_max_tokens_per_rank
    assert T % 128 == 0
    full = pool_blocks_upper_bound(T, lay.num_ranks, lay.num_topk, lay.num_local_experts, lay.block_m)
    assert 1 <= lay.pool_blocks <= full
    if lay.pool == "full":
        assert lay.pool_blocks == full


@settings(max_examples=250, deadline=None)
@given(
    h=st.integers(1, 64).map(lambda v: v * 128),
    i=st.integers(1, 64).map(lambda v: v * 128),
    r=st.sampled_from([1, 2, 4, 8]),
    el=st.integers(1, 48),
    k=st.integers(1, 8),
    t=st.integers(1, 9000),
    pool=st.sampled_from(["full", "ring"]),
    gran=st.sampled_from([64, 128]),
    bm=st.sampled_from([64, 128]),
)
def test_layout_invariants(h, i, r, el, k, t, pool, gran, bm):
    e = r * el
    k = min(k, e)
    lay = symm_buffer_layout(h, i, e, k, t, r, block_m=bm, act_sf_gran=gran, pool=pool)
    check_invariants(lay)
    assert lay.num_max_tokens_per_rank == -(-t // 128) * 128
    if pool == "ring":
        s = fused_schedule(lay.num_max_tokens_per_rank, r, k, e, bm)
        assert lay.pool_blocks == s.ring_blocks


def _ep8_slice(name: str, pool: str = "full") -> BufferLayout:
    p = get_preset(name)
    return symm_buffer_layout(p.hidden, p.intermediate, p.num_experts, p.num_topk, 8192, 8, pool=pool)


def test_flash_full_pool_sizes():
    lay = _ep8_slice("flash")
    check_invariants(lay)
    T, H, I, K, R, EL = 8192, 4096, 2048, 6, 8, 32
    blocks = (8 * 8192 * 6 + 32 * 127) // 128
    assert blocks == 3103 and lay.pool_blocks == blocks
    rows = 3103 * 128
    expected = {
        "x": 8192 * 4096,
        "x_sf": 8192 * (4096 // 128) * 4,
        "l1_pool": 3103 * 128 * 4096,
        "l1_pool_sf": (4096 // 128) * rows * 4,
        "l1_pool_src": rows * 4,
        "l1_pool_weight": rows * 4,
        "l1_pool_dst": rows * 8,
        "l2_pool": 3103 * 128 * 2048,
        "l2_pool_sf": (2048 // 128) * rows * 4,
        "combine": 6 * 8192 * 4096 * 2,
    }
    # Workspace: each part starts on 128 bytes, the whole rounded to 1024.
    ws_parts = [
        R * EL * 4,  # expert_recv_counts      1024
        (EL + 1) * 4,  # expert_pool_offsets      132
        EL * 4,  # expert_cursors           128
        32 * 4,  # grid_sync                128
        # fused_banks 78600: counts and cursors per global expert, three per-block counters,
        # the ticket and the split pipeline's three words
        2 * (2 * 256 + 3 * blocks + 4) * 4,
        32 * 4,  # launch_epoch             128
        256 * 4,  # ep_send_counts          1024
        257 * 4,  # ep_send_offsets         1028
        256 * 4,  # ep_send_cursors         1024
        EL * (R + 1) * 4,  # ep_src_rows             1152
        EL * 4,  # ep_expert_totals         128
        2 * (2 * R * EL + 2 * R) * 4,  # ep_banks    4224
        R * 8,  # peer_bases                64
    ]
    ws_end = 0
    for part in ws_parts:
        ws_end = up(ws_end, 128) + part
    expected["workspace"] = up(ws_end, 1024)
    assert expected["workspace"] == up(
        1024 + 256 + 128 + 128 + 78720 + 128 + 1024 + 1152 + 1024 + 1152 + 128 + 4224 + 64, 1024
    )
    expected["send_list"] = 8192 * 6 * 8

    for name, nbytes in expected.items():
        assert lay.region(name).nbytes == nbytes, name
    assert (lay.num_max_tokens_per_rank, lay.hidden, lay.intermediate, lay.num_topk) == (T, H, I, K)

    # Hand sum: each region rounded up to 1024, in buffer order.
    total = (
        up(8192 * 4096)  # x
        + up(8192 * 32 * 4)  # x_sf
        + up(3103 * 128 * 4096)  # l1_pool
        + up(32 * 3103 * 128 * 4)  # l1_pool_sf
        + up(3103 * 128 * 4)  # l1_pool_src
        + up(3103 * 128 * 4)  # l1_pool_weight
        + up(3103 * 128 * 8)  # l1_pool_dst
        + up(3103 * 128 * 2048)  # l2_pool
        + up(16 * 3103 * 128 * 4)  # l2_pool_sf
        + up(6 * 8192 * 4096 * 2)  # combine
        + up(8192 * 6 * 8)  # send_list
        + expected["workspace"]  # workspace
    )
    assert lay.total_bytes == total == 2_960_653_312
    assert lay.region("l1_pool").offset == sum(up(expected[n]) for n in TOP_LEVEL[:2])


def test_flash_ring_pool_sizes():
    lay = _ep8_slice("flash", pool="ring")
    check_invariants(lay)
    ring = 8 * (29 + 4) + 4
    assert ring == 268 and lay.pool_blocks == ring
    assert lay.region("l1_pool").nbytes == 268 * 128 * 4096
    assert lay.region("l2_pool").nbytes == 268 * 128 * 2048
    assert lay.region("l1_pool_sf").nbytes == 32 * 268 * 128 * 4
    # Per-row metadata is indexed by the global pool row: full size even with a ring.
    assert lay.region("l1_pool_dst").nbytes == 3103 * 128 * 8
    # Token-indexed regions do not depend on the pool choice.
    full = _ep8_slice("flash")
    for name in ("x", "x_sf", "combine"):
        assert lay.region(name).nbytes == full.region(name).nbytes


def test_pro_full_and_ring_sizes():
    lay = _ep8_slice("pro")
    check_invariants(lay)
    T, H, I, K, EL = 8192, 7168, 3072, 6, 48
    blocks = (8 * 8192 * 6 + 48 * 127) // 128
    assert blocks == 3119 and lay.pool_blocks == blocks
    rows = blocks * 128
    assert lay.region("x").nbytes == T * H
    assert lay.region("x_sf").nbytes == T * (H // 128) * 4
    assert lay.region("l1_pool").nbytes == rows * H
    assert lay.region("l1_pool_sf").nbytes == (H // 128) * rows * 4
    assert lay.region("l2_pool").nbytes == rows * I
    assert lay.region("l2_pool_sf").nbytes == (I // 128) * rows * 4
    assert lay.region("combine").nbytes == K * T * H * 2
    assert lay.workspace_region("expert_recv_counts").nbytes == 8 * EL * 4
    assert lay.total_bytes == sum(up(r.nbytes) for r in lay.regions)

    ring = _ep8_slice("pro", pool="ring")
    assert ring.pool_blocks == 8 * (22 + 4) + 4 == 212
    assert ring.region("l1_pool").nbytes == 212 * 128 * 7168


def test_act_sf_gran_64_doubles_l2_scales():
    a = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8, act_sf_gran=128)
    b = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8, act_sf_gran=64)
    assert b.region("l2_pool_sf").nbytes == 2 * a.region("l2_pool_sf").nbytes
    assert b.region("l2_pool_sf").shape == (32, a.pool_rows)


def test_ring_options():
    lay = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8, pool="ring", ring_blocks=500)
    assert lay.pool_blocks == 500
    # An explicit ring larger than the worst case is clamped to the full pool.
    lay = symm_buffer_layout(4096, 2048, 256, 6, 256, 8, pool="ring", ring_blocks=10**6)
    assert lay.pool_blocks == (8 * 256 * 6 + 32 * 127) // 128
    # A smaller token bound gives the smaller schedule's ring (lag 14 at 2048).
    lay = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8, pool="ring", num_tokens_bound=2048)
    assert lay.pool_blocks == 8 * (14 + 4) + 4


def test_one_rank_has_no_staging_regions():
    lay = symm_buffer_layout(4096, 2048, 32, 6, 8192, 1)
    check_invariants(lay)
    names = {r.name for r in lay.regions} | {w.name for w in lay.workspace}
    assert not names & {"x", "x_sf", "send_list", "ep_banks", "peer_bases"}
    eight = symm_buffer_layout(4096, 2048, 256, 6, 8192, 8)
    # The same per-rank slice across 8 ranks stages its inputs: x and x_sf come first.
    assert eight.region("l1_pool").offset == up(8192 * 4096) + up(8192 * 32 * 4)
    assert lay.region("l1_pool").offset == 0


@pytest.mark.parametrize(
    "kwargs, argname",
    [
        (dict(hidden=100), "hidden=100"),
        (dict(hidden=0), "hidden=0"),
        (dict(intermediate=2000), "intermediate=2000"),
        (dict(num_experts=250), "num_experts=250"),
        (dict(num_topk=0), "num_topk=0"),
        (dict(num_topk=300), "num_topk=300"),
        (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank=0"),
        (dict(num_ranks=0), "num_ranks=0"),
        (dict(block_m=256), "block_m: expected one of 64, 128, got 256"),
        (dict(act_sf_gran=32), "act_sf_gran: expected one of 64, 128, got 32"),
        (dict(pool="half"), "pool='half'"),
        (dict(pool="ring", ring_blocks=0), "ring_blocks=0"),
        (dict(ring_blocks=100), "ring_blocks=100"),
        (dict(pool="ring", num_tokens_bound=9000), "num_tokens_bound=9000"),
    ],
)
def test_validation_names_argument(kwargs, argname):
    args = dict(hidden=4096, intermediate=2048, num_experts=256, num_topk=6, num_max_tokens_per_rank=8192, num_ranks=8)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        symm_buffer_layout(**args)
    assert argname in str(err.value)


def test_region_lookup_errors():
    lay = _ep8_slice("flash")
    with pytest.raises(ValueError, match="nope"):
        lay.region("nope")


def test_format_report():
    lay = _ep8_slice("flash", pool="ring")
    text = lay.format_report()
    for r in lay.regions:
        assert r.name in text
    for w in lay.workspace:
        assert "  " + w.name in text
    total_lines = [ln for ln in text.splitlines() if ln.startswith("total")]
    assert len(total_lines) == 1
    assert f"{lay.total_bytes / MiB:.2f}" in total_lines[0]
    assert "134.00" in text  # l1_pool: 268 blocks * 128 rows * 4096 B
    report = lay.report()
    assert [n for n, _, _ in report] == TOP_LEVEL[:-1] + ["send_list", "workspace"]
    assert all(mib == pytest.approx(b / MiB) for _, b, mib in report)


def test_a_streaming_layout_holds_the_call_wide_pool_of_a_streamed_call():
    from megamoe_rt.schedule.layout import stream_blocks_per_expert

    t, e, k = 1000, 16, 4
    lay = symm_buffer_layout(512, 256, e, k, t, stream_slots=3, stream_tokens=100)
    cap = lay.num_max_tokens_per_rank
    # A token routes to an expert at most once: an expert takes at most every token's row.
    assert stream_blocks_per_expert(cap, 1, 128) == -(-cap // 128)
    ws = {r.name: r for r in lay.workspace}
    assert ws["stream_expert_blocks"].shape == (e, stream_blocks_per_expert(cap, 1, 128))
    assert ws["stream_block_map"].shape == (lay.full_pool_blocks,)
    assert ws["stream_blocks_claimed"].shape == (1,)
    assert lay.region("stream_call_topk_idx").shape == (cap, k)
    # The block map covers every laid-out block of a call: all pairs, rounded up per expert.
    assert lay.full_pool_blocks >= -(-cap * k // 128)
    plain = symm_buffer_layout(512, 256, e, k, t)
    assert "stream_block_map" not in {r.name for r in plain.workspace}
