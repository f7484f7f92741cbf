"""The chunk-ready input ring's device side, as far as the CPU can check it: the ring kernels
and a producer kernel written outside megamoe_rt compile against the producer header with the
options the package hands out, and the header's generation layout is the protocol model's."""

from __future__ import annotations

from megamoe_rt.jit.compiler import _nvrtc, _program_log
from megamoe_rt.kernels import stream as sk
from megamoe_rt.kernels.interface import stream as decl
from megamoe_rt.kernels.registry import all_kernel_specs
from megamoe_rt.schedule import streaming

# What a user's router might do: softmax-free top-1 over 4 experts, one block per chunk.
USER_PRODUCER = r"""
#include "stream/producer.cuh"
using namespace megamoe_rt;

extern "C" __global__ void my_router(stream::StreamRing ring, const float* logits, u32 num_tokens, u32 chunk) {
    __shared__ bool free_slot;
    if (threadIdx.x == 0) free_slot = stream::wait_slot_free(ring, chunk, 10ull * 1000 * 1000 * 1000);
    __syncthreads();
    if (!free_slot) __trap();
    i32* idx = stream::chunk_topk_idx(ring, chunk);
    float* w = stream::chunk_topk_weights(ring, chunk);
    for (u32 t = threadIdx.x; t < ring.tokens_per_slot; t += blockDim.x) {
        const u32 token = chunk * ring.tokens_per_slot + t;
        i32 best = -1;
        float best_logit = -1e30f;
        for (int e = 0; token < num_tokens && e < 4; ++e)
            if (logits[token * 4 + e] > best_logit) best_logit = logits[token * 4 + e], best = e;
        idx[t * ring.num_topk] = best;
        w[t * ring.num_topk] = 1.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) stream::publish_route(ring, stream::producer_epoch(ring), chunk);
}
"""


def test_the_ring_kernels_are_built_with_every_other_kernel():
    names = {s.name for s in all_kernel_specs()}
    assert {s.name for s in sk.kernel_specs()} <= names


def test_a_producer_kernel_outside_the_package_compiles_against_the_header():
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(USER_PRODUCER.encode(), b"my_router.cu", 0, [], [])
    try:
        opts = [o.encode() for o in sk.producer_options()]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert int(result) == 0, _program_log(nvrtc, prog)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def test_the_headers_generation_layout_is_the_protocol_models():
    assert decl.EPOCH_SHIFT.value == streaming.EPOCH_SHIFT
    assert streaming.chunk_generation(3, 0) == (3 << decl.EPOCH_SHIFT.value) | 1
