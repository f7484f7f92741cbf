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
    using Params = SwigluFp8Params;

    template <class Cfg>
    static __device__ __forceinline__ void store(const Params& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                 const SharedStorage<Cfg>& sm, const PromotedSums<Cfg>& out);
};

// One 128-column pass of a thread's sums (64 channels, gate pair i and up pair i + 8): the
// activations of its two rows (row0, row0 + 8) and each row's amax over the quad's 64 channels.
__device__ __forceinline__ void swiglu_activations(const SwigluFp8Params& p, const Tile& tile, u32 row0,
                                                   const float (&out)[64], float (&act)[2][16], float (&amax)[2]) {
    const bool clamp = (p.flags & Flags::kClamp) != 0;
    const float limit = p.swiglu_limit;
#pragma unroll
    for (u32 half = 0; half < 2; ++half) {
        const u32 r = row0 + 8 * half;
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
}

// Writes one pass's 64 channels of the thread's two rows as e4m3 with the rows' requant scales;
// `owns_scale`: this pass holds the first channel of the rows' requant group.
template <class Cfg>
__device__ __forceinline__ void store_e4m3_pass(const SwigluFp8Params& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                const float (&act)[2][16], const float (&scale)[2], bool owns_scale) {
    const u32 channel0 = mt.col0(tile) / 2;  // 128 interleaved columns -> 64 channels
    const u32 q = mt.lane % 4;
#pragma unroll
    for (u32 half = 0; half < 2; ++half) {
        const u32 r = mt.row0 + 8 * half;
        const bool keep = r < tile.rows;  // rows past the tile's end take part in the shuffles only
        const u32 row = tile.d_row0 + r;
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
                two[e] = ptx::cvt_rn_satfinite_e4m3x2_f32(__fdiv_rn(act[half][2 * i], scale[half]),
                                                          __fdiv_rn(act[half][2 * i + 1], scale[half]));
            }
            packed[j] = two[0] | (two[1] << 16);
        }
        const ptx::u32x4 t = quad_transpose_b32(packed, q);  // lane k's word q, k = 0..3
        const ptx::u32x4 run = {__byte_perm(t.x, t.y, 0x5410), __byte_perm(t.z, t.w, 0x5410),
                                __byte_perm(t.x, t.y, 0x7632), __byte_perm(t.z, t.w, 0x7632)};
        u8* dst = p.d + static_cast<u64>(row) * p.d_row_stride_bytes + channel0;
        if (keep) ptx::st_global_v4_b32(dst + 16 * q, run);
        if (keep && q == 0 && owns_scale)
            p.d_sf[static_cast<u64>(channel0 / Cfg::kOutSfGran) * p.d_sf_row_stride + row] = scale[half];
    }
}

template <class Cfg>
__device__ __forceinline__ void SwigluFp8Epilogue::store(const Params& p, const Tile& tile, const MathThread<Cfg>& mt,
                                                         const SharedStorage<Cfg>& sm, const PromotedSums<Cfg>& out) {
    // A 128-wide requant group is 256 interleaved gate|up columns: both passes of one warpgroup
    // (128 x 256) or two warpgroups side by side (64 x 256).
    constexpr bool kGroupInThread = Cfg::kOutSfGran == 64 || Cfg::kNPasses == 2;
    static_assert(kGroupInThread || (Cfg::kWgN == 2 && Cfg::kWgM == 1),
                  "128-wide requant groups need the 64 x 256 or 128 x 256 tile");
    static_assert(Cfg::kBSfN == 64,
                  "the SwiGLU epilogue expects gate/up interleaved in 64-column halves with their own B scales");
    constexpr u32 kPasses = Cfg::kNPasses;
    float act[kPasses][2][16];
    float amax[kPasses][2];
#pragma unroll
    for (u32 ps = 0; ps < kPasses; ++ps)
        swiglu_activations(p, tile, mt.row0, pass_sums<Cfg>(out, ps), act[ps], amax[ps]);
    if constexpr (Cfg::kOutSfGran == 128 && kPasses == 2) {
        // Both halves of the group are this thread's.
#pragma unroll
        for (u32 half = 0; half < 2; ++half) amax[0][half] = amax[1][half] = fmaxf(amax[0][half], amax[1][half]);
    } else if constexpr (Cfg::kOutSfGran == 128) {
        // The group's other 64 channels belong to the neighbouring warpgroup.
        float* xchg = sm.scratch();
        const u32 local = mt.row0 - mt.wg_m * Cfg::kWgTileM;
        if (mt.lane % 4 == 0) {
            xchg[mt.wg_n * Cfg::kWgTileM + local] = amax[0][0];
            xchg[mt.wg_n * Cfg::kWgTileM + local + 8] = amax[0][1];
        }
        ptx::bar_sync(sync::kEpilogueBarrier, Cfg::kNumMathThreads);
        amax[0][0] = fmaxf(amax[0][0], xchg[(1 - mt.wg_n) * Cfg::kWgTileM + local]);
        amax[0][1] = fmaxf(amax[0][1], xchg[(1 - mt.wg_n) * Cfg::kWgTileM + local + 8]);
        ptx::bar_sync(sync::kEpilogueBarrier, Cfg::kNumMathThreads);  // reads done before the next tile writes
    }
    const bool pow2 = (p.flags & Flags::kPow2Scale) != 0;
#pragma unroll
    for (u32 ps = 0; ps < kPasses; ++ps) {
        const float scale[2] = {requant_scale(amax[ps][0], pow2), requant_scale(amax[ps][1], pow2)};
        // The group's first 64 channels carry its scale: every pass with 64-wide groups, else
        // the first pass (128 x 256) or the first warpgroup (64 x 256).
        const bool owns_scale = Cfg::kOutSfGran == 64 || (kPasses == 2 ? ps == 0 : mt.wg_n == 0);
        store_e4m3_pass<Cfg>(p, tile, mt.on_pass(ps), act[ps], scale, owns_scale);
    }
}

}  // namespace megamoe_rt::gemm
