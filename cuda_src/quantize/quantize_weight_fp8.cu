// 128x128 block FP8 quantization of weights: bf16 or fp32 [groups, N, K] ->
// e4m3 [groups, N, K] + fp32 scales [groups, N / 128, K / 128], with the recipe of
// megamoe_rt/reference.py (scale = max(amax, 1e-4) / 448, code = e4m3_rn_satfinite(x / scale)).
// One CTA per 128x128 block; each thread owns 32 consecutive columns of one row (few
// enough live values that the IEEE-division slow path needs no stack).

#include "common/types.cuh"
#include "interface/quantize.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt {

// WeightQuantizeParams and kWeightQuantThreads: interface/quantize.cuh (generated).
constexpr u32 kColsPerThread = 32;
static_assert(kWeightQuantThreads * kColsPerThread == 128 * 128, "one thread per 32 columns of a 128 x 128 block");

template <bool kInputBf16>
__global__ void __launch_bounds__(kWeightQuantThreads)
    quantize_fp8_128x128(const __grid_constant__ WeightQuantizeParams p) {
    __shared__ float warp_amax[kWeightQuantThreads / 32];
    const u32 kb_count = p.k / 128;
    const u32 nb_count = p.n / 128;
    const u32 row = threadIdx.x / 4;                      // 0..127 within the block
    const u32 col0 = (threadIdx.x % 4) * kColsPerThread;  // 0, 32, 64, 96
    for (u32 blk = blockIdx.x; blk < p.num_blocks; blk += gridDim.x) {
        const u32 kb = blk % kb_count;
        const u32 nb = (blk / kb_count) % nb_count;
        const u32 g = blk / (kb_count * nb_count);
        const u64 elem = (static_cast<u64>(g) * p.n + nb * 128 + row) * p.k + kb * 128 + col0;
        float v[kColsPerThread];
        if constexpr (kInputBf16) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const ptx::u32x4 raw = ptx::ld_global_nc_v4_u32(static_cast<const u16*>(p.w) + elem + 8 * c);
                const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    v[8 * c + 2 * i] = ptx::bf16_bits_to_f32(static_cast<u16>(words[i] & 0xFFFFu));
                    v[8 * c + 2 * i + 1] = ptx::bf16_bits_to_f32(static_cast<u16>(words[i] >> 16));
                }
            }
        } else {
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                const ptx::u32x4 raw = ptx::ld_global_nc_v4_u32(static_cast<const float*>(p.w) + elem + 4 * c);
                v[4 * c] = __uint_as_float(raw.x);
                v[4 * c + 1] = __uint_as_float(raw.y);
                v[4 * c + 2] = __uint_as_float(raw.z);
                v[4 * c + 3] = __uint_as_float(raw.w);
            }
        }
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < static_cast<int>(kColsPerThread); ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
        for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
        if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
        __syncthreads();
#pragma unroll
        for (u32 w = 0; w < kWeightQuantThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
        __syncthreads();  // warp_amax is rewritten for the next block
        const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
        u8* dst = p.q + elem;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            u32 words[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int e = 16 * c + 4 * i;
                const u16 lo = ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(v[e], scale), __fdiv_rn(v[e + 1], scale));
                const u16 hi = ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(v[e + 2], scale), __fdiv_rn(v[e + 3], scale));
                words[i] = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
            }
            *reinterpret_cast<ptx::u32x4*>(dst + 16 * c) = ptx::u32x4{words[0], words[1], words[2], words[3]};
        }
        if (threadIdx.x == 0) p.sf[blk] = scale;
    }
}

}  // namespace megamoe_rt
