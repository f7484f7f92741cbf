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
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt {

// QuantizeParams, kGroupSize and kQuantizeThreads: interface/quantize.cuh (generated).
constexpr int kElemsPerThread = 8;                                                // one 16-byte bf16 load
constexpr int kThreadsPerGroup = static_cast<int>(kGroupSize) / kElemsPerThread;  // 16: half a warp

template <bool kInputBf16>
__global__ void __launch_bounds__(kQuantizeThreads) quantize_fp8_1x128(const __grid_constant__ QuantizeParams p) {
    const u32 lane = threadIdx.x % 32;
    const u32 sub = threadIdx.x % kThreadsPerGroup;
    // A warp takes two consecutive groups per step (one per half-warp) and the
    // whole warp iterates together, so the shuffles below can name all 32 lanes.
    const u64 warps_per_step = static_cast<u64>(gridDim.x) * (kQuantizeThreads / 32);

    for (u64 pair = (static_cast<u64>(blockIdx.x) * kQuantizeThreads + threadIdx.x) / 32; pair * 2 < p.num_groups;
         pair += warps_per_step) {
        const u64 g = pair * 2 + lane / kThreadsPerGroup;
        const bool active = g < p.num_groups;
        const u64 elem = g * kGroupSize + sub * kElemsPerThread;
        float v[kElemsPerThread];
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) v[i] = 0.0f;
        if (active) {
            if constexpr (kInputBf16) {
                const ptx::u32x4 raw = ptx::ld_global_nc_v4_u32(static_cast<const u16*>(p.x) + elem);
                const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    v[2 * i] = ptx::bf16_bits_to_f32(static_cast<u16>(words[i] & 0xFFFFu));
                    v[2 * i + 1] = ptx::bf16_bits_to_f32(static_cast<u16>(words[i] >> 16));
                }
            } else {
                const float* src = static_cast<const float*>(p.x) + elem;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const ptx::u32x4 raw = ptx::ld_global_nc_v4_u32(src + 4 * h);
                    v[4 * h + 0] = __uint_as_float(raw.x);
                    v[4 * h + 1] = __uint_as_float(raw.y);
                    v[4 * h + 2] = __uint_as_float(raw.z);
                    v[4 * h + 3] = __uint_as_float(raw.w);
                }
            }
        }
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < kElemsPerThread; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
        for (int offset = kThreadsPerGroup / 2; offset > 0; offset /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));  // stays within the half

        const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
        u32 packed[2];
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            const u16 lo =
                ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(v[4 * w + 0], scale), __fdiv_rn(v[4 * w + 1], scale));
            const u16 hi =
                ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(v[4 * w + 2], scale), __fdiv_rn(v[4 * w + 3], scale));
            packed[w] = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
        }
        if (active) {
            ptx::st_global_v2_u32(p.q + elem, ptx::u32x2{packed[0], packed[1]});
            if (sub == 0) ptx::st_global_f32(p.sf + g, scale);
        }
    }
}

}  // namespace megamoe_rt
