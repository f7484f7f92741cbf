// Runtime parameters of the grouped FP8 GEMM. The host mirror is
// megamoe_rt.kernels.gemm.GemmParams (ctypes); every offset and stride is
// computed there and arrives here ready to use.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::gemm {

enum class GroupLayout : u32 {
    kContiguous = 0,  // rows of group g at [group_offsets[g], group_offsets[g+1]), starts BLOCK_M-aligned
    kMasked = 1,      // group g owns rows [g * masked_rows, (g + 1) * masked_rows); first masked_counts[g] valid
};

struct GemmParams {
    u32 num_rows;             // rows of A (contiguous) or num_groups * masked_rows (masked)
    u32 n;                    // output columns per group
    u32 k;                    // reduction length, a multiple of 128
    u32 num_groups;
    u32 masked_rows;          // masked layout: rows per group
    u32 flags;                // Flags below
    const i32* group_offsets; // contiguous: [num_groups + 1]
    const i32* group_counts;  // contiguous, optional: valid rows per group (nullptr: all)
    const i32* masked_counts; // masked: [num_groups]
    const float* sfb;         // [num_groups, n / kBSfN, k / 128]
    u8* d;                    // StoreBf16Epilogue: bf16 rows; SwigluFp8Epilogue: e4m3 rows
    u64 d_row_stride_bytes;
    float* d_sf;              // SwigluFp8Epilogue: scales, [n / 2 / gran, d_sf_row_stride] (K-block major)
    u64 d_sf_row_stride;      // in floats (>= num_rows)
    const float* row_weight;  // SwigluFp8Epilogue: per-row top-k weight [num_rows]
    const u64* row_dst;       // ScatterBf16Epilogue: per-row destination byte address
    float swiglu_limit;
    u32 pad_;
};

struct Flags {
    static constexpr u32 kClamp = 1u << 0;       // clamp gate <= limit, |up| <= limit
    static constexpr u32 kPow2Scale = 1u << 1;   // round requant scales up to powers of two
};

}  // namespace megamoe_rt::gemm
