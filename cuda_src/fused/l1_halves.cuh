// The fused kernel's L1 tile: kL1BlockN (256) interleaved gate|up columns of a 128-row block,
// run as two 128x128 GEMM tiles in turn.
//
// Why two halves: a 128-channel requant group is 256 interleaved columns, and a math thread
// that held both 128-column halves' promoted sums at once (the 128x256 two-pass tile) needs 128
// of them beside its 64 accumulators, more than the fused kernel's math warpgroups can hold on
// every NVRTC without spilling (bench/NOTES.md). One half at a time keeps 64 + 64. The first
// half's SwiGLU activations and its rows' amax wait in shared memory (L1Park) until the second
// half's amax is known; then both halves are requantized with the group's scale and stored, as
// the unfused layer's 128x256 and 64x256 tiles store them (same values, same codes).
// With 64-wide requant groups each half is a group of its own and is stored at once.
#pragma once

#include "common/types.cuh"
#include "gemm/epilogue_swiglu_fp8.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/params.cuh"
#include "gemm/tile_scheduler.cuh"
#include "interface/fused.cuh"

namespace megamoe_rt::fused {

// Per math thread: the first half's 32 activations (two rows x 16) and the two rows' amax, laid
// out value-major so that a warp's accesses fall in distinct banks.
struct L1Park {
    static constexpr u32 kThreads = 256;  // the two math warpgroups
    static constexpr u32 kValues = 2 * 16 + 2;
    static constexpr u32 kBytes = kValues * kThreads * 4;
    static_assert(kBytes == kL1ParkBytes, "the host reserves kL1ParkBytes (interface/fused.cuh) for the park");

    float* base;  // kValues x kThreads floats, after the GEMM carve-up
    u32 thread;   // this thread's column: its index among the math threads

    __device__ __forceinline__ float& at(u32 value) const { return base[value * kThreads + thread]; }
};

// The second half of an L1 tile: the next kBlockN columns of the same rows.
__device__ __forceinline__ gemm::Tile second_l1_half(gemm::Tile tile) {
    tile.n0 += kBlockN;
    return tile;
}

// The first half's promoted sums are in `out`: with 64-wide groups store it, else park its
// activations and amax.
template <class Cfg>
__device__ __forceinline__ void finish_first_l1_half(const gemm::SwigluFp8Params& p, const gemm::Tile& tile,
                                                     const gemm::MathThread<Cfg>& mt, const L1Park& park,
                                                     const float (&out)[64]) {
    static_assert(Cfg::kNPasses == 1 && Cfg::kBlockN == kBlockN, "one 128-column half at a time");
    float act[2][16];
    float amax[2];
    gemm::swiglu_activations(p, tile, mt.row0, out, act, amax);
    if constexpr (Cfg::kOutSfGran == 64) {
        const bool pow2 = (p.flags & gemm::Flags::kPow2Scale) != 0;
        const float scale[2] = {gemm::requant_scale(amax[0], pow2), gemm::requant_scale(amax[1], pow2)};
        gemm::store_e4m3_pass<Cfg>(p, tile, mt, act, scale, true);
    } else {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
#pragma unroll
            for (u32 j = 0; j < 16; ++j) park.at(16 * h + j) = act[h][j];
            park.at(32 + h) = amax[h];
        }
    }
}

// The second half's promoted sums are in `out` (`tile`: the first half's, as the queue holds
// it): with 64-wide groups store the second half; else requantize both halves with the rows'
// amax over the whole group and store them, the first from the park. The group's scale is
// written once, with the first half (its first 64 channels).
template <class Cfg>
__device__ __forceinline__ void finish_l1_tile(const gemm::SwigluFp8Params& p, const gemm::Tile& tile,
                                               const gemm::MathThread<Cfg>& mt, const L1Park& park,
                                               const float (&out)[64]) {
    static_assert(Cfg::kOutSfGran == 64 || Cfg::kOutSfGran == 128, "requant groups of 64 or 128 channels");
    const gemm::Tile half1 = second_l1_half(tile);
    const bool pow2 = (p.flags & gemm::Flags::kPow2Scale) != 0;
    float act[2][16];
    float amax[2];
    gemm::swiglu_activations(p, half1, mt.row0, out, act, amax);
    if constexpr (Cfg::kOutSfGran == 128) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) amax[h] = fmaxf(amax[h], park.at(32 + h));
    }
    const float scale[2] = {gemm::requant_scale(amax[0], pow2), gemm::requant_scale(amax[1], pow2)};
    gemm::store_e4m3_pass<Cfg>(p, half1, mt, act, scale, Cfg::kOutSfGran == 64);
    if constexpr (Cfg::kOutSfGran == 128) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
#pragma unroll
            for (u32 j = 0; j < 16; ++j) act[h][j] = park.at(16 * h + j);
        }
        gemm::store_e4m3_pass<Cfg>(p, tile, mt, act, scale, true);
    }
}

}  // namespace megamoe_rt::fused
