// One step of per-token 1x128 FP8 quantization, shared by the quantize kernel
// (quantize_fp8.cu) and producers that quantize a streamed chunk straight into its ring slot
// (megamoe_rt/routers.py), so both give the same bytes:
//
//   scale = max(amax, 1e-4) / 448      (fp32, IEEE division)
//   code  = e4m3_rn_satfinite(x / scale)
#pragma once

#include "common/types.cuh"
#include "interface/quantize.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt {

constexpr int kElemsPerThread = 8;                                                // one 16-byte bf16 load
constexpr int kThreadsPerGroup = static_cast<int>(kGroupSize) / kElemsPerThread;  // 16: half a warp

// A whole warp, converged: groups 2 * pair and 2 * pair + 1 of `x` (one per half-warp; groups
// of kGroupSize consecutive elements, num_groups in all) into e4m3 codes `q` and scales `sf`.
// The whole warp calls it together, so the shuffles can name all 32 lanes.
template <bool kInputBf16>
__device__ __forceinline__ void quantize_group_pair(const void* x, u64 num_groups, u64 pair, u32 lane, u8* q,
                                                    float* sf) {
    const u32 sub = lane % kThreadsPerGroup;
    const u64 g = pair * 2 + lane / kThreadsPerGroup;
    const bool active = g < num_groups;
    const u64 elem = g * kGroupSize + sub * kElemsPerThread;
    float v[kElemsPerThread];
#pragma unroll
    for (int i = 0; i < kElemsPerThread; ++i) v[i] = 0.0f;
    if (active) {
        if constexpr (kInputBf16) {
            const ptx::u32x4 raw = ptx::ld_global_nc_v4_u32(static_cast<const u16*>(x) + elem);
            const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[2 * i] = ptx::bf16_bits_to_f32(static_cast<u16>(words[i] & 0xFFFFu));
                v[2 * i + 1] = ptx::bf16_bits_to_f32(static_cast<u16>(words[i] >> 16));
            }
        } else {
            const float* src = static_cast<const float*>(x) + elem;
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
        const u16 lo = ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(v[4 * w + 0], scale), __fdiv_rn(v[4 * w + 1], scale));
        const u16 hi = ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(v[4 * w + 2], scale), __fdiv_rn(v[4 * w + 3], scale));
        packed[w] = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
    }
    if (active) {
        ptx::st_global_v2_u32(q + elem, ptx::u32x2{packed[0], packed[1]});
        if (sub == 0) ptx::st_global_f32(sf + g, scale);
    }
}

}  // namespace megamoe_rt
