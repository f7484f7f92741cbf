"""Expert parallelism over two GPUs: each rank owns half of the experts and its own tokens.

Run on a machine with two Hopper GPUs joined by NVLink:
    megamoe-rt launch -n 2 examples/two_rank_ep.py
or under MPI (NVSHMEM then bootstraps through MPI; needs mpi4py):
    mpirun -n 2 python examples/two_rank_ep.py
or with torchrun (or a plain srun) on one node:
    torchrun --nproc-per-node 2 examples/two_rank_ep.py
"""

import numpy as np

import megamoe_rt
from megamoe_rt.ep.launch import context_from_env
from megamoe_rt.ep.symm import NvshmemRuntime

# Before CuPy is imported: without the cu13 extra or a Hopper GPU, one line says what is missing
# (under `megamoe-rt launch`, once for all ranks).
megamoe_rt.require_gpu()

import cupy as cp

ctx = context_from_env()
cp.cuda.Device(ctx.device).use()
tokens, hidden, intermediate, experts, topk = 256, 2048, 1024, 16, 4
local = experts // ctx.world_size
first = ctx.rank * local

# Every rank draws the same global expert weights and loads its own slice of them.
rs = cp.random.RandomState(1234)
w1, w1_sf = megamoe_rt.quantize_weight_fp8(
    rs.standard_normal((experts, 2 * intermediate, hidden), dtype=cp.float32) / np.float32(hidden**0.5)
)
w2, w2_sf = megamoe_rt.quantize_weight_fp8(
    rs.standard_normal((experts, hidden, intermediate), dtype=cp.float32) / np.float32(intermediate**0.5)
)

# This rank's tokens and their routing over all experts (global ids).
rng = cp.random.RandomState(ctx.rank)
x, x_sf = megamoe_rt.quantize_fp8(rng.standard_normal((tokens, hidden), dtype=cp.float32))
logits = rng.standard_normal((tokens, experts), dtype=cp.float32)
topk_idx = cp.argsort(-logits, axis=1)[:, :topk].astype(cp.int32)
topk_weights = cp.full((tokens, topk), 1.0 / topk, dtype=cp.float32)


def run(mode):
    layer = megamoe_rt.MegaMoE(
        hidden, intermediate, experts, topk, num_max_tokens_per_rank=tokens, mode=mode, group=ctx
    )
    layer.load_weights(
        w1[first : first + local], w1_sf[first : first + local], w2[first : first + local], w2_sf[first : first + local]
    )
    y_bits = layer(x, x_sf, topk_idx, topk_weights)
    layer.close()  # collective: every rank frees its symmetric buffer together
    return (y_bits.astype(cp.uint32) << 16).view(cp.float32)  # bf16 bits -> float32


y = run(None)  # the default: one fused persistent kernel per rank
y_unfused = run("unfused")  # separate kernels, same protocol
print(
    f"rank {ctx.rank}: experts {first}..{first + local - 1}, y {y.shape}, mean |y| {float(cp.abs(y).mean()):.4f}, "
    f"fused vs unfused max |diff| {float(cp.abs(y - y_unfused).max()):.2e}"
)

NvshmemRuntime.initialize(ctx).finalize()  # collective: NVSHMEM torn down on every rank
