"""JAX interop: a router's output as JAX arrays into MegaMoE and the result back, zero-copy.

The hidden states, the router and the expert weights live in JAX. The inputs reach the layer
through DLPack with their native dtypes (jnp.float8_e4m3fn codes, float32 scales, int32 top-k
ids from jax.lax.top_k, float32 top-k weights); nothing is copied. The layer returns a CuPy
uint16 array of bf16 bits; offered through DLPack as bfloat16 (the same memory, its DLPack dtype
relabelled: CuPy has no bfloat16 to export), jax.dlpack.from_dlpack makes a jnp.bfloat16 array
over it. A sample of tokens is checked against the NumPy reference (megamoe_rt.reference).

megamoe_rt itself never imports jax; only this example needs it (pip install "jax[cuda13]").

Run on a Hopper GPU:  python examples/jax_interop.py
"""

import ctypes
import os
import sys

import numpy as np

# JAX takes most of the GPU's memory when it starts unless told not to; the layer allocates
# its buffer and output through CuPy, beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = jnp = None

FP8_MAX = 448.0


def divide(a: "jax.Array", b) -> "jax.Array":
    """a / b, correctly rounded like the reference's and the kernels' division. XLA may turn a
    division by a broadcast divisor into a multiplication by its reciprocal (one rounding more),
    so the divisor is made full-size first; the quantizers run eagerly, op by op, so it stays an
    operand of its own and not a constant XLA could fold."""
    return jnp.divide(a, jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def quantize_rows(x: "jax.Array"):
    """[T, H] -> float8_e4m3fn codes [T, H] and float32 scales [T, H/128], one scale per 1x128
    group: scale = max(amax, 1e-4) / 448 (docs/NUMERICS.md)."""
    t, h = x.shape
    groups = x.astype(jnp.float32).reshape(t, h // 128, 128)
    sf = divide(jnp.maximum(jnp.abs(groups).max(axis=-1), 1e-4), FP8_MAX)
    q = jnp.clip(divide(groups, sf[..., None]), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(t, h), sf


def quantize_blocks(w: "jax.Array"):
    """[..., N, K] -> float8_e4m3fn codes and float32 scales [..., N/128, K/128] per 128x128 block."""
    *lead, n, k = w.shape
    blocks = w.astype(jnp.float32).reshape(*lead, n // 128, 128, k // 128, 128)
    sf = divide(jnp.maximum(jnp.abs(blocks).max(axis=(-3, -1)), 1e-4), FP8_MAX)
    q = jnp.clip(divide(blocks, sf[..., :, None, :, None]), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(w.shape), sf


# --- the output as bfloat16 through DLPack ------------------------------------------------
# The structs of dlpack.h this needs: a tensor's dtype, and where the tensor sits in the two
# capsule kinds (DLManagedTensor starts with it; DLManagedTensorVersioned, DLPack 1.x, after
# its version, context, deleter and flags).


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_KDL_INT, _KDL_UINT, _KDL_BFLOAT = 0, 1, 4
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class Bfloat16Bits:
    """16-bit integers holding bf16 bits (the layer's output), offered through DLPack as
    bfloat16: the producer's own capsule, the same memory, with its dtype relabelled."""

    def __init__(self, bits):
        self.bits = bits

    def __dlpack_device__(self):
        return self.bits.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        capsule = self.bits.__dlpack__(**kwargs)
        name = _capsule_name(capsule)
        addr = _capsule_pointer(capsule, name)
        if name == b"dltensor_versioned":
            addr += _DLManagedTensorVersioned.dl_tensor.offset
        dtype = _DLTensor.from_address(addr).dtype
        if (dtype.code, dtype.bits, dtype.lanes) not in ((_KDL_UINT, 16, 1), (_KDL_INT, 16, 1)):
            raise TypeError(f"expected 16-bit integers of bf16 bits, got DLPack dtype {dtype.code}/{dtype.bits}")
        dtype.code = _KDL_BFLOAT
        return capsule


def dlpack_carries_fp8(device) -> bool:
    """Older JAX releases cannot export float8 arrays through DLPack."""
    try:
        jax.device_put(jnp.zeros(1, jnp.float8_e4m3fn), device).__dlpack__()
        return True
    except Exception:
        return False


def main() -> int:
    if jax is None:
        sys.exit('jax_interop: this example needs JAX (pip install "jax[cuda13]"); megamoe_rt itself does not')
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        sys.exit("jax_interop: JAX sees no CUDA GPU; this example needs a Hopper GPU (sm_90: H100/H200)")
    if getattr(device, "compute_capability", "9.0") != "9.0":
        sys.exit(f"jax_interop: {device.device_kind} is not a Hopper GPU; megamoe_rt kernels need sm_90 (H100/H200)")

    import megamoe_rt
    from megamoe_rt import reference as ref

    ordinal = getattr(device, "local_hardware_id", device.id)  # the CUDA ordinal behind JAX's device
    megamoe_rt.require_gpu("jax_interop", ordinal=ordinal)  # the cu13 extra: CuPy, NVRTC, ...

    tokens, hidden, intermediate, experts, topk = 512, 2048, 1024, 16, 4
    check_tokens = 32
    keys = jax.random.split(jax.random.key(0), 4)

    with jax.default_device(device):
        # The model side: bf16 hidden states and a softmax/top-k router (jax.lax.top_k gives int32 ids).
        hidden_states = jax.random.normal(keys[0], (tokens, hidden)).astype(jnp.bfloat16)
        router = (jax.random.normal(keys[1], (hidden, experts)) / hidden**0.5).astype(jnp.bfloat16)
        logits = (hidden_states @ router).astype(jnp.float32)
        top_logits, topk_idx = jax.lax.top_k(logits, topk)  # int32 [T, K]
        topk_weights = jax.nn.softmax(top_logits, axis=-1)  # float32 [T, K]
        topk_idx = topk_idx.at[:8, -1].set(-1)  # -1: an empty slot

        x, x_sf = quantize_rows(hidden_states)  # float8_e4m3fn, float32
        # Expert weights: w1 holds the gate rows, then the up rows.
        w1, w1_sf = quantize_blocks(jax.random.normal(keys[2], (experts, 2 * intermediate, hidden)) / hidden**0.5)
        w2, w2_sf = quantize_blocks(jax.random.normal(keys[3], (experts, hidden, intermediate)) / intermediate**0.5)

    native_fp8 = dlpack_carries_fp8(device)
    if not native_fp8:
        print("this JAX cannot export float8 through DLPack: passing the codes as uint8 (a copy on the device)")

    def fp8(a):
        """A float8 array as the layer takes it: itself, or its raw e4m3 codes (JAX has no views)."""
        return a if native_fp8 else jax.lax.bitcast_convert_type(a, jnp.uint8)

    inputs = (fp8(x), x_sf, topk_idx, topk_weights, fp8(w1), w1_sf, fp8(w2), w2_sf)
    # JAX computes asynchronously on streams of its own: the arrays are complete before the
    # layer, on CuPy's current stream, reads them.
    jax.block_until_ready(inputs)
    x_in, x_sf, topk_idx, topk_weights, w1_in, w1_sf, w2_in, w2_sf = inputs

    layer = megamoe_rt.MegaMoE(hidden, intermediate, experts, topk, num_max_tokens_per_rank=tokens, device=ordinal)
    layer.load_weights(w1_in, w1_sf, w2_in, w2_sf)
    y_bits = layer(x_in, x_sf, topk_idx, topk_weights)  # CuPy uint16 [T, H]
    layer.synchronize()  # the call is done (and its inputs were valid) before JAX reads y
    y = jax.dlpack.from_dlpack(Bfloat16Bits(y_bits))  # the same memory, as jnp.bfloat16
    assert y.dtype == jnp.dtype(jnp.bfloat16) and y.shape == (tokens, hidden)
    assert y.unsafe_buffer_pointer() == y_bits.data.ptr  # no copy on the way out either

    # Check a sample of tokens against the NumPy reference on the very same quantized inputs
    # (np.asarray of a float8 JAX array is an ml_dtypes float8_e4m3fn array, the reference's E4M3).
    sample = np.sort(np.random.default_rng(0).choice(tokens, check_tokens, replace=False))
    y_ref = ref.moe_forward(
        np.asarray(x)[sample],
        np.asarray(x_sf)[sample],
        np.asarray(topk_idx)[sample],
        np.asarray(topk_weights)[sample],
        np.asarray(w1),
        np.asarray(w1_sf),
        np.asarray(w2),
        np.asarray(w2_sf),
    )
    diff = ref.calc_diff(np.asarray(y.astype(jnp.float32))[sample], y_ref.astype(np.float32))
    print(f"y: {y.shape} {y.dtype} on {device}; calc_diff vs reference on {check_tokens} tokens: {diff:.2e}")
    if not diff < 1e-3:
        sys.exit(f"jax_interop: calc_diff {diff:.3e} is above the 1e-3 bar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
