// Conversion instructions, one wrapper per PTX instruction.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::ptx {

// Two fp32 values to a packed pair of e4m3 codes, `lo` in bits 0..7.
// Round to nearest even; satfinite clamps to +-448 (e4m3fn has no infinity).
__device__ __forceinline__ u16 cvt_rn_satfinite_e4m3x2_f32(float lo, float hi) {
    u16 packed;
    // PTX puts the first source operand in the upper half.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// bf16 bits to fp32: exact, a bf16 is the upper half of an fp32.
__device__ __forceinline__ float bf16_bits_to_f32(u16 bits) { return __uint_as_float(static_cast<u32>(bits) << 16); }

}  // namespace megamoe_rt::ptx

namespace megamoe_rt::ptx {

// Two fp32 values to packed bf16x2 (`lo` in bits 0..15), round to nearest even.
__device__ __forceinline__ u32 cvt_rn_bf16x2_f32(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

}  // namespace megamoe_rt::ptx
