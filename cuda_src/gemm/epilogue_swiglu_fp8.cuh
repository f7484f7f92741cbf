// The L1 epilogue: SwiGLU (optional clamp) x the row's top-k weight, requantized
// to e4m3 per row in groups of 64 or 128 channels with the raw scale
// max(amax, 1e-10) / 448 (or that rounded up to a power of two), written
// straight into the L2 input and its K-block-major scales.
//
// B (w1) is prepared with gate and up interleaved in 64-row halves, so each
// warpgroup's 128 columns are 64 gate then the 64 up of the same channels and a
// thread holds gate (pair i) and up (pair i + 8) of the same channel.
#pragma once

#include "common/types.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/quad_transpose.cuh"
#include "gemm/tile_scheduler.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/sync.cuh"
#include "sync/named_barriers.cuh"

namespace megamoe_rt::gemm {

__device__ __forceinline__ float requant_scale(float amax, bool pow2) {
    float scale = __fdiv_rn(fmaxf(amax, 1e-10f), 448.0f);
    if (pow2) {
        // Round up to the next power of two (scales here are normal floats).
        u32 bits = __float_as_uint(scale);
        if (bits & 0x7FFFFFu) bits = (bits & 0xFF800000u) + 0x800000u;
        scale = __uint_as_float(bits);
    }
    return scale;
}

struct SwigluFp8Epilogue {
    template <class Cfg>
    static __device__ __forceinline__ void store(const GemmParams& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& sm, const float (&out)[64]);
};

template <class Cfg>
__device__ __forceinline__ void SwigluFp8Epilogue::store(const GemmParams& p, const Tile& tile,
                                                         const MathThread<Cfg>& mt, const SharedStorage<Cfg>& sm,
                                                         const float (&out)[64]) {
    // A 128-wide requant group is 256 interleaved gate|up columns: two warpgroups side by side.
    static_assert(Cfg::kOutSfGran == 64 || (Cfg::kWgN == 2 && Cfg::kWgM == 1),
                  "128-wide requant groups need the 64 x 256 tile");
    static_assert(Cfg::kBSfN == 64,
                  "the SwiGLU epilogue expects gate/up interleaved in 64-column halves with their own B scales");
    const bool clamp = (p.flags & Flags::kClamp) != 0;
    const float limit = p.swiglu_limit;
    const u32 channel0 = mt.col0(tile) / 2;  // 128 interleaved columns -> 64 channels
    float act[2][16];
    float amax[2];
#pragma unroll
    for (u32 half = 0; half < 2; ++half) {
        const u32 r = mt.row0 + 8 * half;
        const float weight = r < tile.rows ? p.row_weight[tile.row0 + r] : 0.0f;
        float m = 0.0f;
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                float gate = out[4 * i + 2 * half + e];
                float up = out[4 * (i + 8) + 2 * half + e];
                if (clamp) {
                    gate = fminf(gate, limit);
                    up = fminf(fmaxf(up, -limit), limit);
                }
                const float a = gate / (1.0f + __expf(-gate)) * up * weight;
                act[half][2 * i + e] = a;
                m = fmaxf(m, fabsf(a));
            }
        }
        // The four lanes of a quad hold the same row.
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
        amax[half] = m;
    }
    if constexpr (Cfg::kOutSfGran == 128) {
        // The group's other 64 channels belong to the neighbouring warpgroup.
        float* xchg = sm.scratch();
        const u32 local = mt.row0 - mt.wg_m * Cfg::kWgTileM;
        if (mt.lane % 4 == 0) {
            xchg[mt.wg_n * Cfg::kWgTileM + local] = amax[0];
            xchg[mt.wg_n * Cfg::kWgTileM + local + 8] = amax[1];
        }
        ptx::bar_sync(sync::kEpilogueBarrier, Cfg::kNumMathThreads);
        amax[0] = fmaxf(amax[0], xchg[(1 - mt.wg_n) * Cfg::kWgTileM + local]);
        amax[1] = fmaxf(amax[1], xchg[(1 - mt.wg_n) * Cfg::kWgTileM + local + 8]);
        ptx::bar_sync(sync::kEpilogueBarrier, Cfg::kNumMathThreads);  // reads done before the next tile writes
    }
    const bool pow2 = (p.flags & Flags::kPow2Scale) != 0;
    const u32 q = mt.lane % 4;
#pragma unroll
    for (u32 half = 0; half < 2; ++half) {
        const u32 r = mt.row0 + 8 * half;
        const bool keep = r < tile.rows;  // rows past the tile's end take part in the shuffles only
        const u32 row = tile.d_row0 + r;
        const float scale = requant_scale(amax[half], pow2);
        // Pair i's two codes land at byte 8i + 2q of the row's 64 channels. Packed two pairs to a
        // word and transposed across the quad, lane q holds bytes 16q..16q+15 (pairs 2q and 2q + 1
        // of every lane) and stores them at once: two 16-byte stores per thread instead of
        // sixteen 2-byte ones.
        u32 packed[4];
#pragma unroll
        for (u32 j = 0; j < 4; ++j) {
            u32 two[2];
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                const u32 i = 2 * j + e;
                two[e] = ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(act[half][2 * i], scale),
                                                          __fdiv_rn(act[half][2 * i + 1], scale));
            }
            packed[j] = two[0] | (two[1] << 16);
        }
        const ptx::u32x4 t = quad_transpose_b32(packed, q);  // lane k's word q, k = 0..3
        const ptx::u32x4 run = {__byte_perm(t.x, t.y, 0x5410), __byte_perm(t.z, t.w, 0x5410),
                                __byte_perm(t.x, t.y, 0x7632), __byte_perm(t.z, t.w, 0x7632)};
        u8* dst = p.d + static_cast<u64>(row) * p.d_row_stride_bytes + channel0;
        if (keep) ptx::st_global_v4_b32(dst + 16 * q, run);
        const bool owns_scale = keep && q == 0 && (Cfg::kOutSfGran == 64 || mt.wg_n == 0);
        if (owns_scale) p.d_sf[static_cast<u64>(channel0 / Cfg::kOutSfGran) * p.d_sf_row_stride + row] = scale;
    }
}

}  // namespace megamoe_rt::gemm
