// Per-token 1x128 FP8 quantization: bf16 or fp32 [rows, hidden] ->
// e4m3 [rows, hidden] + fp32 scales [rows, hidden / 128].
//
//   scale = max(amax, 1e-4) / 448      (fp32, IEEE division)
//   code  = e4m3_rn_satfinite(x / scale)
//
// This is bit-for-bit the recipe of megamoe_rt/reference.py; the 1e-4 floor
// keeps all-zero groups and padding rows finite.

#include "common/types.cuh"
#include "interface/quantize.cuh"
#include "quantize/group_1x128.cuh"

namespace megamoe_rt {

// QuantizeParams and kQuantizeThreads: interface/quantize.cuh (generated); the step:
// quantize/group_1x128.cuh.
template <bool kInputBf16>
__global__ void __launch_bounds__(kQuantizeThreads) quantize_fp8_1x128(const __grid_constant__ QuantizeParams p) {
    const u32 lane = threadIdx.x % 32;
    // A warp takes two consecutive groups per step (one per half-warp) and the
    // whole warp iterates together, so the shuffles can name all 32 lanes.
    const u64 warps_per_step = static_cast<u64>(gridDim.x) * (kQuantizeThreads / 32);
    for (u64 pair = (static_cast<u64>(blockIdx.x) * kQuantizeThreads + threadIdx.x) / 32; pair * 2 < p.num_groups;
         pair += warps_per_step)
        quantize_group_pair<kInputBf16>(p.x, p.num_groups, pair, lane, p.q, p.sf);
}

}  // namespace megamoe_rt
