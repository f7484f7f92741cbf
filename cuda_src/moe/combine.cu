// Combine: y[t] = bf16(sum over valid slots k, in slot order, of fp32(partial[k][t])).
// A token with no valid slot gets zeros. One block per token (grid-strided).

#include "common/types.cuh"
#include "moe/combine_token.cuh"
#include "moe/params.cuh"

namespace megamoe_rt::moe {

template <typename IdxT>
__global__ void __launch_bounds__(kCombineThreads) moe_combine(const __grid_constant__ MoeParams p) {
    __shared__ u32 valid_mask;
    for (u32 token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
        if (threadIdx.x < 32) {
            const u32 mask = valid_slot_mask<IdxT>(p, token);  // by the whole first warp
            if (threadIdx.x == 0) valid_mask = mask;
        }
        __syncthreads();
        combine_token(p, token, valid_mask, threadIdx.x, kCombineThreads);
        __syncthreads();  // valid_mask is rewritten for the next token
    }
}

}  // namespace megamoe_rt::moe
