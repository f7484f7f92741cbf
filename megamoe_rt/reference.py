"""NumPy reference for the FP8 MoE numerics contract.

Every GPU kernel in this package is tested against the functions here, so the
recipes below are the contract, not an approximation of it.  Only NumPy and
ml_dtypes are used (arguments are checked by runtime/args.py, itself NumPy only);
importing this module never touches a GPU library.

Formats
    E4M3 is ``ml_dtypes.float8_e4m3fn`` (max finite 448, no infinities),
    BF16 is ``ml_dtypes.bfloat16``.  Scale factors ("sf") are float32 and a
    value is ``float32(code) * sf``.

Quantization (inputs, weights, intermediate activations)
    For each group (1x128 or 1x64 for activations, 128x128 for weights):
    ``amax = max|x|`` in float32, ``scale = float32(max(amax, floor)) / 448.0``
    computed as a single correctly rounded float32 division, and
    ``code = e4m3_rne(clip(x / scale, -448, 448))`` with a float32 division.
    The floor is ``ACT_SF_AMAX_FLOOR`` for inputs and weights and
    ``REQUANT_SF_AMAX_FLOOR`` for the intermediate requantization, where the
    scale may optionally be rounded up to a power of two.

Block-scaled GEMM
    For each K block, the partial dot products of the E4M3 codes are exact
    (they are summed in float64, which cannot round for 128 terms), rounded
    once to float32 and then accumulated in float32 as
    ``acc += partial * a_sf * b_sf`` (left to right).

MoE forward
    Per (token, slot) routed to expert ``e``: ``L1 = x @ w1[e].T``,
    ``act = swiglu(gate, up) * topk_weight`` in float32, requantized to E4M3,
    ``out = act @ w2[e].T`` rounded to BF16.  The token output is the float32
    sum of the BF16 slot outputs over valid slots in slot order, rounded to
    BF16.  Slots with expert id -1 are empty and contribute nothing; so is a
    slot naming an expert an earlier slot of the same token already names (the
    first occurrence counts), as the layer drops it.  Ids outside ``[-1, E)``
    are refused with a ValueError.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# The scalar checks every entry point shares: runtime/args.py imports nothing of the package.
from megamoe_rt.runtime import args

__all__ = [
    "FP8_E4M3_MAX",
    "ACT_SF_AMAX_FLOOR",
    "REQUANT_SF_AMAX_FLOOR",
    "BLOCK_K",
    "E4M3",
    "BF16",
    "quantize_act_1x128",
    "quantize_weight_128x128",
    "dequantize_act",
    "dequantize_weight",
    "fp8_block_gemm",
    "swiglu",
    "requant_rows",
    "moe_forward",
    "drop_repeated_ids",
    "calc_diff",
    "random_moe_inputs",
]

FP8_E4M3_MAX = 448.0
ACT_SF_AMAX_FLOOR = 1e-4
REQUANT_SF_AMAX_FLOOR = 1e-10
BLOCK_K = 128

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

_F32 = np.dtype(np.float32)
_FLOAT_INPUTS = (np.dtype(np.float16), BF16, _F32, np.dtype(np.float64))
_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_ACT_GRANS = (64, 128)

# ---------------------------------------------------------------------------
# Argument checking.  Every message starts with the argument name so a failing
# call site is obvious from the exception alone.
# ---------------------------------------------------------------------------


def _describe(arr: np.ndarray) -> str:
    return f"dtype {arr.dtype}, shape {tuple(arr.shape)}"


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d) for d in dtypes)


def _check_array(name: str, arr, dtypes, ndim=None, layout: str = "") -> np.ndarray:
    """Require a NumPy array of one of ``dtypes``.

    ``ndim`` is an exact rank, a 1-tuple ``(n,)`` meaning "at least n", or None.
    """
    if not isinstance(arr, np.ndarray):
        kind = f"{type(arr).__module__}.{type(arr).__qualname__}"
        raise TypeError(f"{name}: expected a numpy.ndarray, got {kind}")
    if arr.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {_describe(arr)}")
    if ndim is not None:
        ok = arr.ndim >= ndim[0] if isinstance(ndim, tuple) else arr.ndim == ndim
        if not ok:
            raise ValueError(f"{name}: expected shape {layout}, got {_describe(arr)}")
    return arr


def _check_shape(name: str, arr: np.ndarray, expected, layout: str) -> None:
    expected = tuple(int(d) for d in expected)
    if tuple(arr.shape) != expected:
        raise ValueError(f"{name}: expected shape {layout} = {expected}, got {_describe(arr)}")


def _check_multiple(name: str, arr: np.ndarray, dim_name: str, value: int, of: int) -> None:
    if value <= 0 or value % of:
        raise ValueError(f"{name}: {dim_name} must be a positive multiple of {of}, got {_describe(arr)}")


def _check_finite(name: str, arr: np.ndarray) -> None:
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected only finite values, got NaN/Inf ({_describe(arr)})")


def _check_gran(name: str, gran) -> int:
    return args.integer_choice(name, gran, _ACT_GRANS)


def _check_limit(name: str, limit):
    if limit is None:
        return None
    try:
        value = float(limit)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected None or a positive float, got {limit!r}") from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected None or a positive finite float, got {limit!r}")
    return np.float32(value)


# ---------------------------------------------------------------------------
# Quantization core.
# ---------------------------------------------------------------------------


def _scale_from_amax(amax: np.ndarray, floor: float) -> np.ndarray:
    # float32 operands, so NumPy performs one IEEE correctly rounded division,
    # matching the kernels' fmaxf(amax, floor) / 448.0f.
    amax = amax.astype(np.float32, copy=False)
    return np.maximum(amax, np.float32(floor)) / np.float32(FP8_E4M3_MAX)


def _round_up_pow2(scale: np.ndarray) -> np.ndarray:
    # frexp gives scale = m * 2**e with m in [0.5, 1); m == 0.5 means scale is
    # already a power of two and must stay unchanged.
    mant, exp = np.frexp(scale)
    exp = np.where(mant == 0.5, exp - 1, exp)
    return np.ldexp(np.float32(1.0), exp).astype(np.float32)


def _encode_e4m3(scaled: np.ndarray) -> np.ndarray:
    # Clipping first mirrors cvt.rn.satfinite; ml_dtypes' cast is round to
    # nearest even, like the hardware conversion.
    lim = np.float32(FP8_E4M3_MAX)
    return np.clip(scaled, -lim, lim).astype(E4M3)


def _quantize_rows(x32: np.ndarray, gran: int, floor: float, pow2: bool):
    """Quantize float32 [T, H] in 1 x ``gran`` groups."""
    rows, cols = x32.shape
    groups = x32.reshape(rows, cols // gran, gran)
    amax = np.max(np.abs(groups), axis=-1)
    sf = _scale_from_amax(amax, floor)
    if pow2:
        sf = _round_up_pow2(sf)
    q = _encode_e4m3(groups / sf[..., None]).reshape(rows, cols)
    return q, sf


def _float_input(name: str, x, ndim, layout: str) -> np.ndarray:
    x = _check_array(name, x, _FLOAT_INPUTS, ndim, layout)
    x32 = x.astype(np.float32)
    _check_finite(name, x32)
    return x32


def quantize_act_1x128(x: np.ndarray):
    """Quantize activations [T, H] per row and 128-column group.

    Returns ``(q, sf)``: E4M3 codes [T, H] and float32 scales [T, H/128].
    """
    x32 = _float_input("x", x, 2, "[T, H]")
    _check_multiple("x", x32, "H (last dim)", x32.shape[1], BLOCK_K)
    return _quantize_rows(x32, BLOCK_K, ACT_SF_AMAX_FLOOR, pow2=False)


def quantize_weight_128x128(w: np.ndarray):
    """Quantize weights [..., N, K] per 128x128 block.

    Returns ``(q, sf)``: E4M3 codes [..., N, K] and float32 scales
    [..., N/128, K/128].
    """
    w32 = _float_input("w", w, (2,), "[..., N, K]")
    *lead, n, k = w32.shape
    _check_multiple("w", w32, "N (dim -2)", n, BLOCK_K)
    _check_multiple("w", w32, "K (dim -1)", k, BLOCK_K)
    blocks = w32.reshape(*lead, n // BLOCK_K, BLOCK_K, k // BLOCK_K, BLOCK_K)
    amax = np.max(np.abs(blocks), axis=(-3, -1))
    sf = _scale_from_amax(amax, ACT_SF_AMAX_FLOOR)
    q = _encode_e4m3(blocks / sf[..., :, None, :, None]).reshape(w32.shape)
    return q, sf


def requant_rows(act: np.ndarray, gran: int = 128, pow2_scale: bool = False):
    """Requantize intermediate activations [n, I] in 1 x ``gran`` groups.

    Uses the ``REQUANT_SF_AMAX_FLOOR`` floor; with ``pow2_scale`` each scale
    is rounded up to the next power of two.  Returns E4M3 [n, I] and float32
    [n, I/gran].
    """
    g = _check_gran("gran", gran)
    a32 = _float_input("act", act, 2, "[n, I]")
    _check_multiple("act", a32, f"I (last dim, gran={g})", a32.shape[1], g)
    return _quantize_rows(a32, g, REQUANT_SF_AMAX_FLOOR, pow2=bool(pow2_scale))


def dequantize_act(q: np.ndarray, sf: np.ndarray, gran: int = 128) -> np.ndarray:
    """float32 [T, H] from E4M3 codes [T, H] and scales [T, H/gran]."""
    g = _check_gran("gran", gran)
    _check_array("q", q, (E4M3,), 2, "[T, H]")
    _check_multiple("q", q, f"H (last dim, gran={g})", q.shape[1], g)
    _check_array("sf", sf, (_F32,), 2, "[T, H/gran]")
    _check_shape("sf", sf, (q.shape[0], q.shape[1] // g), "[T, H/gran]")
    return q.astype(np.float32) * np.repeat(sf, g, axis=1)


def dequantize_weight(q: np.ndarray, sf: np.ndarray) -> np.ndarray:
    """float32 [..., N, K] from E4M3 codes and 128x128 block scales."""
    _check_array("q", q, (E4M3,), (2,), "[..., N, K]")
    *lead, n, k = q.shape
    _check_multiple("q", q, "N (dim -2)", n, BLOCK_K)
    _check_multiple("q", q, "K (dim -1)", k, BLOCK_K)
    _check_array("sf", sf, (_F32,), None)
    _check_shape("sf", sf, (*lead, n // BLOCK_K, k // BLOCK_K), "[..., N/128, K/128]")
    full = np.repeat(np.repeat(sf, BLOCK_K, axis=-2), BLOCK_K, axis=-1)
    return q.astype(np.float32) * full


# ---------------------------------------------------------------------------
# GEMM, activation and MoE forward.
# ---------------------------------------------------------------------------


def _check_gemm_operands(a, a_sf, b, b_sf, a_gran):
    g = _check_gran("a_gran", a_gran)
    _check_array("a", a, (E4M3,), 2, "[M, K]")
    _check_array("b", b, (E4M3,), 2, "[N, K]")
    m, k = a.shape
    n = b.shape[0]
    _check_multiple("a", a, "K (last dim)", k, BLOCK_K)
    _check_multiple("b", b, "N (dim 0)", n, BLOCK_K)
    _check_shape("b", b, (n, k), "[N, K] with K from a")
    _check_array("a_sf", a_sf, (_F32,), 2, "[M, K/a_gran]")
    _check_shape("a_sf", a_sf, (m, k // g), "[M, K/a_gran]")
    _check_array("b_sf", b_sf, (_F32,), 2, "[N/128, K/128]")
    _check_shape("b_sf", b_sf, (n // BLOCK_K, k // BLOCK_K), "[N/128, K/128]")
    _check_finite("a_sf", a_sf)
    _check_finite("b_sf", b_sf)
    return g


def _block_gemm(a, a_sf, b, b_sf, g):
    """fp8_block_gemm without argument checks (operands already validated)."""
    m, k = a.shape
    n = b.shape[0]
    a64 = a.astype(np.float64)
    b64_t = b.astype(np.float64).T
    acc = np.zeros((m, n), dtype=np.float32)
    for kb in range(k // g):
        cols = slice(kb * g, (kb + 1) * g)
        # Products of E4M3 values are exact in float64 and so is a sum of up
        # to 128 of them, so this partial is independent of summation order.
        partial = (a64[:, cols] @ b64_t[cols, :]).astype(np.float32)
        b_scale = np.repeat(b_sf[:, (kb * g) // BLOCK_K], BLOCK_K)
        acc += partial * a_sf[:, kb, None] * b_scale[None, :]
    return acc


def fp8_block_gemm(a, a_sf, b, b_sf, *, a_gran: int = 128) -> np.ndarray:
    """Block-scaled FP8 GEMM ``a @ b.T`` -> float32 [M, N].

    ``a`` E4M3 [M, K] with float32 scales [M, K/a_gran] (a_gran 64 or 128),
    ``b`` E4M3 [N, K] with float32 128x128 block scales [N/128, K/128].
    Memory stays O(M*N + (M+N)*K): K blocks are processed one at a time.
    """
    g = _check_gemm_operands(a, a_sf, b, b_sf, a_gran)
    return _block_gemm(a, a_sf, b, b_sf, g)


def swiglu(gate, up, limit=None) -> np.ndarray:
    """``silu(gate) * up`` in float32, optionally clamped.

    With ``limit``: gate is clamped from above only, up to [-limit, limit].
    """
    gate = _check_array("gate", gate, _FLOAT_INPUTS).astype(np.float32)
    up = _check_array("up", up, _FLOAT_INPUTS).astype(np.float32)
    if gate.shape != up.shape:
        raise ValueError(f"up: expected the same shape as gate {tuple(gate.shape)}, got {_describe(up)}")
    lim = _check_limit("limit", limit)
    if lim is not None:
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
    # exp(-gate) overflows to inf for very negative gate; gate / inf is the
    # correct limit (-0), so the overflow is expected and silenced.
    with np.errstate(over="ignore"):
        silu = gate / (np.float32(1.0) + np.exp(-gate))
    return silu * up


def _check_moe_inputs(x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf):
    """Validate the MoE operands; returns (T, H, K, E, I)."""
    _check_array("x", x, (E4M3,), 2, "[T, H]")
    t, h = x.shape
    _check_multiple("x", x, "H (last dim)", h, BLOCK_K)
    _check_array("x_sf", x_sf, (_F32,), 2, "[T, H/128]")
    _check_shape("x_sf", x_sf, (t, h // BLOCK_K), "[T, H/128]")
    _check_finite("x_sf", x_sf)

    _check_array("topk_idx", topk_idx, _INDEX_DTYPES, 2, "[T, K]")
    k = topk_idx.shape[1]
    if topk_idx.shape[0] != t or k < 1:
        raise ValueError(f"topk_idx: expected shape [T, K] with T={t}, K>=1, got {_describe(topk_idx)}")
    _check_array("topk_weights", topk_weights, (_F32,), 2, "[T, K]")
    _check_shape("topk_weights", topk_weights, (t, k), "[T, K]")

    _check_array("w1", w1, (E4M3,), 3, "[E, 2I, H]")
    e, two_i, w1_h = w1.shape
    if two_i % 2 or (two_i // 2) % BLOCK_K or two_i == 0 or w1_h != h:
        raise ValueError(
            f"w1: expected shape [E, 2I, H] with I a positive multiple of 128 and H={h}, got {_describe(w1)}"
        )
    i = two_i // 2
    _check_array("w1_sf", w1_sf, (_F32,), 3, "[E, 2I/128, H/128]")
    _check_shape("w1_sf", w1_sf, (e, two_i // BLOCK_K, h // BLOCK_K), "[E, 2I/128, H/128]")
    _check_array("w2", w2, (E4M3,), 3, "[E, H, I]")
    _check_shape("w2", w2, (e, h, i), "[E, H, I]")
    _check_array("w2_sf", w2_sf, (_F32,), 3, "[E, H/128, I/128]")
    _check_shape("w2_sf", w2_sf, (e, h // BLOCK_K, i // BLOCK_K), "[E, H/128, I/128]")
    _check_finite("w1_sf", w1_sf)
    _check_finite("w2_sf", w2_sf)

    bad = (topk_idx < -1) | (topk_idx >= e)
    if np.any(bad):
        first = tuple(int(v) for v in np.argwhere(bad)[0])
        raise ValueError(
            f"topk_idx: expert ids must lie in [-1, {e}) for E={e}, "
            f"got {int(topk_idx[first])} at {first} ({_describe(topk_idx)})"
        )
    valid = topk_idx >= 0
    # Weights of empty slots are never read, so only valid ones must be finite.
    if not np.all(np.isfinite(topk_weights[valid])):
        raise ValueError(
            f"topk_weights: expected finite weights on valid slots, got NaN/Inf ({_describe(topk_weights)})"
        )
    return t, h, k, e, i


def moe_forward(
    x,
    x_sf,
    topk_idx,
    topk_weights,
    w1,
    w1_sf,
    w2,
    w2_sf,
    *,
    swiglu_limit=None,
    act_sf_gran: int = 128,
    pow2_scale: bool = False,
    return_partials: bool = False,
):
    """Reference MoE FFN forward -> BF16 [T, H].

    See the module docstring for the recipe.  With ``return_partials`` the
    result is ``(y, partials, valid)``: BF16 [K, T, H] per-slot outputs (zero
    for empty slots) and the bool [T, K] mask of valid slots.
    """
    gran = _check_gran("act_sf_gran", act_sf_gran)
    limit = _check_limit("swiglu_limit", swiglu_limit)
    t, h, k, _, i = _check_moe_inputs(x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf)

    topk_idx = drop_repeated_ids(topk_idx)
    valid = topk_idx >= 0
    partials = np.zeros((k, t, h), dtype=BF16)
    for expert in np.unique(topk_idx[valid]):
        tok, slot = np.nonzero(topk_idx == expert)
        l1 = _block_gemm(x[tok], x_sf[tok], w1[expert], w1_sf[expert], BLOCK_K)
        act = swiglu(l1[:, :i], l1[:, i:], limit) * topk_weights[tok, slot][:, None]
        q, sf = _quantize_rows(act, gran, REQUANT_SF_AMAX_FLOOR, pow2=bool(pow2_scale))
        out = _block_gemm(q, sf, w2[expert], w2_sf[expert], gran)
        partials[slot, tok] = out.astype(BF16)

    # Slot-order float32 sum over valid slots only; skipping (rather than
    # adding the zero partial) keeps the sign of zero sums well defined.
    acc = np.zeros((t, h), dtype=np.float32)
    for s in range(k):
        acc = np.where(valid[:, s, None], acc + partials[s].astype(np.float32), acc)
    y = acc.astype(BF16)
    if return_partials:
        return y, partials, valid
    return y


# ---------------------------------------------------------------------------
# Helpers for tests and users.
# ---------------------------------------------------------------------------


def drop_repeated_ids(topk_idx):
    """``topk_idx`` with every slot that repeats an earlier slot's expert of the same token set
    to -1 (the first occurrence is kept): what the layer routes."""
    idx = np.asarray(topk_idx)
    if idx.ndim != 2 or idx.shape[1] < 2:
        return idx
    same = idx[:, :, None] == idx[:, None, :]  # [T, slot, earlier slot]
    earlier = np.tril(np.ones((idx.shape[1],) * 2, dtype=bool), k=-1)
    repeated = (same & earlier).any(axis=2) & (idx >= 0)
    return np.where(repeated, np.asarray(-1, dtype=idx.dtype), idx)


def calc_diff(a, b) -> float:
    """Normalized difference ``1 - 2<a,b> / (<a,a> + <b,b>)`` in float64.

    0 for identical inputs, 2 for ``b = -a``; 0.0 when both are all zero.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    for name, arr in (("a", a), ("b", b)):
        if arr.dtype.kind not in "fc" and arr.dtype != BF16:
            # The layer returns bf16 as uint16 bits: compared as integers they mean nothing.
            raise TypeError(
                f"{name}: expected floating-point values, got {_describe(arr)} "
                "(bf16 bits as uint16: view them as float first, e.g. (bits.astype(np.uint32) << 16).view(np.float32))"
            )
    if a.shape != b.shape:
        raise ValueError(f"b: expected the same shape as a {tuple(a.shape)}, got {_describe(b)}")
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    # Scaled by the largest magnitude so that squares of large values do not overflow.
    scale = float(max(np.max(np.abs(a64), initial=0.0), np.max(np.abs(b64), initial=0.0)))
    if not np.isfinite(scale):
        return float("nan")
    if scale == 0.0:
        return 0.0
    a64 /= scale
    b64 /= scale
    denom = float(np.sum(a64 * a64 + b64 * b64))
    return float(1.0 - 2.0 * float(np.sum(a64 * b64)) / denom)


def _check_count(name: str, value, minimum: int) -> int:
    return args.integer(name, value, minimum=minimum)


def random_moe_inputs(
    rng,
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    num_topk: int,
    *,
    empty_slot_prob: float = 0.0,
    x_scale: float = 1.0,
    weight_scale: float = 1.0,
    idx_dtype=np.int32,
) -> dict:
    """Random quantized MoE operands for ``moe_forward``.

    ``x`` is normal with std ``x_scale``; weights are normal with std
    ``weight_scale / sqrt(fan_in)`` so that outputs are O(1).  Each token gets
    ``num_topk`` distinct experts; each slot is then emptied (-1) with
    probability ``empty_slot_prob``.  Routing weights are a softmax over the
    slots (positive, also on empty slots, which consumers must ignore).
    Returns a dict with keys x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2,
    w2_sf.
    """
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    t = _check_count("num_tokens", num_tokens, 0)
    h = _check_count("hidden", hidden, 1)
    i = _check_count("intermediate", intermediate, 1)
    e = _check_count("num_experts", num_experts, 1)
    k = _check_count("num_topk", num_topk, 1)
    if h % BLOCK_K or i % BLOCK_K:
        raise ValueError(f"hidden/intermediate: expected multiples of 128, got {h}, {i}")
    if k > e:
        raise ValueError(f"num_topk: expected <= num_experts={e} (distinct experts), got {k}")
    if not 0.0 <= empty_slot_prob <= 1.0:
        raise ValueError(f"empty_slot_prob: expected a probability in [0, 1], got {empty_slot_prob}")
    if np.dtype(idx_dtype) not in _INDEX_DTYPES:
        raise TypeError(f"idx_dtype: expected int32 or int64, got {np.dtype(idx_dtype)}")

    x, x_sf = quantize_act_1x128(rng.standard_normal((t, h), dtype=np.float32) * np.float32(x_scale))
    w1_std = np.float32(weight_scale / np.sqrt(h))
    w2_std = np.float32(weight_scale / np.sqrt(i))
    w1, w1_sf = quantize_weight_128x128(rng.standard_normal((e, 2 * i, h), dtype=np.float32) * w1_std)
    w2, w2_sf = quantize_weight_128x128(rng.standard_normal((e, h, i), dtype=np.float32) * w2_std)

    # argsort of uniform noise gives a random permutation per token, so the
    # first k entries are distinct experts.
    idx = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(idx_dtype)
    idx[rng.random((t, k)) < empty_slot_prob] = -1
    logits = rng.standard_normal((t, k))
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights = (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
    return {
        "x": x,
        "x_sf": x_sf,
        "topk_idx": idx,
        "topk_weights": weights,
        "w1": w1,
        "w1_sf": w1_sf,
        "w2": w2,
        "w2_sf": w2_sf,
    }
