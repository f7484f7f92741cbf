"""The epilogues' wide stores (gemm/quad_transpose.cuh, epilogue_bf16.cuh, epilogue_swiglu_fp8.cuh)
modelled lane by lane: what a quad stores 16 bytes per lane must be, byte for byte, what the
accumulator layout puts at each column (one 2- or 4-byte store per pair)."""

from __future__ import annotations

import numpy as np
import pytest


def exchange_across(w: np.ndarray, a: int, b: int, mask: int) -> None:
    """One exchange of a butterfly round, for all four lanes at once (w[lane, slot]): lanes q and
    q ^ mask trade a word, the lower lane giving slot b and taking the upper lane's slot a into it."""
    upper = [(q & mask) != 0 for q in range(4)]
    sent = [w[q, a] if upper[q] else w[q, b] for q in range(4)]
    received = [sent[q ^ mask] for q in range(4)]
    for q in range(4):
        w[q, a if upper[q] else b] = received[q]


def quad_transpose(v: np.ndarray) -> np.ndarray:
    """``v[lane, k]``: lane's word for group k (4 lanes of a quad). Returns the words each lane
    ends with, step by step as gemm/quad_transpose.cuh computes them: two butterfly rounds of
    xor shuffles (lanes q ^ 2, then q ^ 1)."""
    w = v.copy()
    for a, b, mask in ((0, 2, 2), (1, 3, 2), (0, 1, 1), (2, 3, 1)):
        exchange_across(w, a, b, mask)
    return w


def test_the_quad_transpose_is_a_transpose():
    v = np.arange(16, dtype=np.uint32).reshape(4, 4)
    np.testing.assert_array_equal(quad_transpose(v), v.T)


def byte_perm(x: int, y: int, selector: int) -> int:
    """__byte_perm(x, y, s): result byte i is byte (s >> 4i) & 7 of the pair {y:x}."""
    pool = int(x) | (int(y) << 32)
    return sum(((pool >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


@pytest.mark.parametrize("seed", range(5))
def test_bf16_rows_stored_16_bytes_per_lane_match_the_pair_layout(seed):
    rng = np.random.default_rng(seed)
    # pairs[lane, g]: the bf16x2 word lane holds for column group g (columns 8g + 2 lane, +1).
    pairs = rng.integers(0, 2**32, size=(4, 16), dtype=np.uint64).astype(np.uint32)
    expected = np.zeros(16 * 4, np.uint32)  # the row's 128 columns as 64 words, by pair stores
    for lane in range(4):
        for g in range(16):
            expected[(8 * g + 2 * lane) // 2] = pairs[lane, g]
    got = np.zeros_like(expected)
    for g0 in range(0, 16, 4):
        run = quad_transpose(pairs[:, g0 : g0 + 4])
        for q in range(4):
            col = 8 * (g0 + q)  # the lane's 16-byte store at column col0 + 8 (g0 + q)
            got[col // 2 : col // 2 + 4] = run[q]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", range(5))
def test_e4m3_rows_stored_16_bytes_per_lane_match_the_pair_layout(seed):
    rng = np.random.default_rng(seed)
    # codes[lane, i]: the two e4m3 codes (a u16) lane holds for pair i, at byte 8 i + 2 lane.
    codes = rng.integers(0, 2**16, size=(4, 8), dtype=np.uint32)
    expected = np.zeros(64, np.uint8)
    for lane in range(4):
        for i in range(8):
            expected[8 * i + 2 * lane] = codes[lane, i] & 0xFF
            expected[8 * i + 2 * lane + 1] = codes[lane, i] >> 8
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 16)).astype(np.uint32)  # packed[lane, j]
    t = quad_transpose(packed)
    got = np.zeros(64, np.uint8)
    for q in range(4):
        x, y, z, w = (int(t[q, k]) for k in range(4))
        run = [byte_perm(x, y, 0x5410), byte_perm(z, w, 0x5410), byte_perm(x, y, 0x7632), byte_perm(z, w, 0x7632)]
        got[16 * q : 16 * q + 16] = np.array(run, np.uint32).view(np.uint8)
    np.testing.assert_array_equal(got, expected)


def test_the_model_follows_the_device_source():
    """The selectors and the store offsets above are the ones in the kernels."""
    from megamoe_rt.jit.paths import cuda_src_dir

    swiglu = (cuda_src_dir() / "gemm" / "epilogue_swiglu_fp8.cuh").read_text()
    assert "__byte_perm(t.x, t.y, 0x5410), __byte_perm(t.z, t.w, 0x5410)" in swiglu
    assert "__byte_perm(t.x, t.y, 0x7632), __byte_perm(t.z, t.w, 0x7632)" in swiglu
    assert "packed[j] = two[0] | (two[1] << 16)" in swiglu and "dst + 16 * q" in swiglu
    bf16 = (cuda_src_dir() / "gemm" / "epilogue_bf16.cuh").read_text()
    assert "base + 2ull * (col0 + 8 * (g0 + q))" in bf16
    transpose = (cuda_src_dir() / "gemm" / "quad_transpose.cuh").read_text()
    for line in (
        "__shfl_xor_sync(0xFFFFFFFFu, upper ? a : b, mask)",
        "exchange_across(w0, w2, hi2, 2);",
        "exchange_across(w1, w3, hi2, 2);",
        "exchange_across(w0, w1, hi1, 1);",
        "exchange_across(w2, w3, hi1, 1);",
    ):
        assert line in transpose, line


# (block_m, block_n) -> (column-split warpgroups kWgN, 128-column passes kNPasses), as gemm/config.cuh
_SWIGLU_TILES = {(64, 256): (2, 1), (128, 256): (1, 2), (128, 128): (1, 1), (64, 128): (1, 1)}


@pytest.mark.parametrize(
    "tile,gran",
    # 128-wide groups need a 256-column tile (the epilogue's rule in kernels/epilogues.py)
    [(t, g) for t in _SWIGLU_TILES for g in (64, 128) if g == 64 or t[1] == 256],
    ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else f"gran{v}",
)
def test_every_requant_group_has_one_scale_writer_and_one_amax(tile, gran):
    """epilogue_swiglu_fp8.cuh on a row: each pass of each column-split warpgroup writes 64
    channels at col0 / 2; a group's amax is taken over the fragments the epilogue combines (one
    pass, both passes of the thread, or both warpgroups) and its scale written by exactly one."""
    wg_n_count, passes = _SWIGLU_TILES[tile]
    n0 = 3 * tile[1]  # any tile of the row
    fragments = [(wg_n, ps) for wg_n in range(wg_n_count) for ps in range(passes)]
    channel0 = {f: (n0 + (f[0] * passes + f[1]) * 128) // 2 for f in fragments}
    combined = {}  # fragment -> the fragments whose amax it takes (as the device combines them)
    for f in fragments:
        if gran == 64:
            combined[f] = [f]
        elif passes == 2:
            combined[f] = [(f[0], 0), (f[0], 1)]
        else:
            combined[f] = [(0, f[1]), (1, f[1])]
    owners = [f for f in fragments if gran == 64 or (f[1] == 0 if passes == 2 else f[0] == 0)]
    groups = {}
    for f in fragments:
        groups.setdefault(channel0[f] // gran, []).append(f)
    assert sorted(channel0[f] // gran for f in owners) == sorted(groups)  # one writer per group
    for f in owners:
        assert channel0[f] % gran == 0  # the writer holds the group's first channel
    for members in groups.values():
        channels = sorted(c for m in members for c in range(channel0[m], channel0[m] + 64))
        assert channels == list(range(channels[0], channels[0] + gran))
        for m in members:
            assert sorted(combined[m]) == sorted(members)  # the amax spans the whole group
