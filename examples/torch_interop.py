"""PyTorch interop: a router's output as torch tensors into MegaMoE and the result back, zero-copy.

The hidden states, the router and the expert weights live in PyTorch. The inputs reach the
layer through DLPack with their native dtypes (torch.float8_e4m3fn codes, float32 scales,
int64 top-k ids, float32 top-k weights); nothing is copied. The layer returns a CuPy uint16
array of bf16 bits, which torch.from_dlpack turns back into a torch.bfloat16 tensor over the
same memory. A sample of tokens is checked against the NumPy reference (megamoe_rt.reference).

megamoe_rt itself never imports torch; only this example needs it.

Run on a Hopper GPU:  python examples/torch_interop.py
"""

import sys

import numpy as np

try:
    import torch
except ImportError:
    torch = None

FP8_MAX = 448.0


def quantize_rows(x: "torch.Tensor"):
    """[T, H] -> float8_e4m3fn codes [T, H] and float32 scales [T, H/128], one scale per 1x128
    group: scale = max(amax, 1e-4) / 448 (docs/NUMERICS.md)."""
    t, h = x.shape
    groups = x.float().reshape(t, h // 128, 128)
    sf = groups.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX
    q = (groups / sf[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, h), sf


def quantize_blocks(w: "torch.Tensor"):
    """[..., N, K] -> float8_e4m3fn codes and float32 scales [..., N/128, K/128] per 128x128 block."""
    *lead, n, k = w.shape
    blocks = w.float().reshape(*lead, n // 128, 128, k // 128, 128)
    sf = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-4) / FP8_MAX
    q = (blocks / sf[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), sf


def dlpack_carries_fp8(device) -> bool:
    """Older PyTorch releases cannot export float8 tensors through DLPack."""
    try:
        torch.empty(1, dtype=torch.float8_e4m3fn, device=device).__dlpack__()
        return True
    except Exception:
        return False


def host(t: "torch.Tensor") -> np.ndarray:
    """A host copy for the NumPy reference; float8 codes as ml_dtypes e4m3."""
    from megamoe_rt import reference as ref

    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).cpu().numpy().view(ref.E4M3)
    return t.cpu().numpy()


def main() -> int:
    if torch is None:
        sys.exit("torch_interop: this example needs PyTorch (pip install torch); megamoe_rt itself does not")
    if not torch.cuda.is_available():
        sys.exit("torch_interop: PyTorch sees no CUDA GPU; this example needs a Hopper GPU (sm_90: H100/H200)")
    if torch.cuda.get_device_capability() != (9, 0):
        name = torch.cuda.get_device_name()
        sys.exit(f"torch_interop: {name} is not a Hopper GPU; megamoe_rt kernels need sm_90 (H100/H200)")

    import megamoe_rt
    from megamoe_rt import reference as ref

    megamoe_rt.require_gpu("torch_interop", ordinal=torch.cuda.current_device())  # the cu13 extra: CuPy, NVRTC, ...
    import cupy as cp

    tokens, hidden, intermediate, experts, topk = 512, 2048, 1024, 16, 4
    check_tokens = 32
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)

    with torch.no_grad():
        # The model side: bf16 hidden states and a softmax/top-k router (torch.topk gives int64 ids).
        hidden_states = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
        router = (torch.randn(hidden, experts, device=device) / hidden**0.5).to(torch.bfloat16)
        logits = (hidden_states @ router).float()
        top_logits, topk_idx = torch.topk(logits, topk, dim=-1)  # int64 [T, K]
        topk_weights = torch.softmax(top_logits, dim=-1).contiguous()  # float32 [T, K]
        topk_idx[:8, -1] = -1  # -1: an empty slot

        x, x_sf = quantize_rows(hidden_states)  # float8_e4m3fn, float32
        # Expert weights: w1 holds the gate rows, then the up rows.
        w1, w1_sf = quantize_blocks(torch.randn(experts, 2 * intermediate, hidden, device=device) / hidden**0.5)
        w2, w2_sf = quantize_blocks(torch.randn(experts, hidden, intermediate, device=device) / intermediate**0.5)

        native_fp8 = dlpack_carries_fp8(device)
        if not native_fp8:
            print("this PyTorch cannot export float8 through DLPack: passing the same bytes as uint8 views")

        def fp8(t: torch.Tensor) -> torch.Tensor:
            """A float8 tensor as the layer takes it: itself, or its raw e4m3 codes (still zero-copy)."""
            return t if native_fp8 else t.view(torch.uint8)

        layer = megamoe_rt.MegaMoE(
            hidden, intermediate, experts, topk, num_max_tokens_per_rank=tokens, device=device.index
        )
        layer.load_weights(fp8(w1), w1_sf, fp8(w2), w2_sf)
        # Same stream as the torch work above, so no extra synchronisation is needed either way.
        stream = torch.cuda.current_stream().cuda_stream
        y_bits = layer(fp8(x), x_sf, topk_idx, topk_weights, stream=stream)  # CuPy uint16 [T, H]
        # int16 carries the same bits and every PyTorch release takes it through DLPack.
        y = torch.from_dlpack(y_bits.view(cp.int16)).view(torch.bfloat16)  # the same memory, as bf16
        assert y.data_ptr() == y_bits.data.ptr and tuple(y.shape) == (tokens, hidden)

        # Check a sample of tokens against the NumPy reference on the very same quantized inputs.
        sample = np.sort(np.random.default_rng(0).choice(tokens, check_tokens, replace=False))
        y_ref = ref.moe_forward(
            host(x)[sample],
            host(x_sf)[sample],
            host(topk_idx)[sample],
            host(topk_weights)[sample],
            host(w1),
            host(w1_sf),
            host(w2),
            host(w2_sf),
        )
        diff = ref.calc_diff(y.float().cpu().numpy()[sample], y_ref.astype(np.float32))
    print(f"y: {tuple(y.shape)} {y.dtype} on {y.device}; calc_diff vs reference on {check_tokens} tokens: {diff:.2e}")
    if not diff < 1e-3:
        sys.exit(f"torch_interop: calc_diff {diff:.3e} is above the 1e-3 bar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
