// Device-side check of a grouped GEMM's group layout (offsets and counts live on the GPU, so
// the host cannot read them without a sync). One thread walks the arrays, launched on the
// GEMM's stream just before it. A violated contract is not a trap (which would end the CUDA
// context): the check reports the first bad entry into the plan's error report and sets
// `state`, which the GEMM reads first and then does nothing, instead of reading or writing
// outside the groups. The host raises from the report.

#include "common/error_report.cuh"
#include "common/types.cuh"
#include "gemm/params.cuh"

namespace megamoe_rt::gemm {

// What the report word of a bad layout carries: the group index and its bad value.
__device__ __forceinline__ bool refuse(errors::ErrorReport* report, u32* state, u32 group, i32 value) {
    errors::report_error(report, errors::ErrorKind::kGroupLayout, group, static_cast<u32>(value));
    *state = 1;
    return false;
}

__device__ __forceinline__ bool contiguous_layout_ok(const GemmParams& p, u32 block_m, errors::ErrorReport* report,
                                                     u32* state) {
    i32 prev = 0;
    for (u32 g = 0; g <= p.num_groups; ++g) {
        const i32 off = p.group_offsets[g];
        if (off < prev || off % static_cast<i32>(block_m) != 0 || static_cast<u32>(off) > p.num_rows)
            return refuse(report, state, g, off);
        // Counts are reported past the offsets' entries: group g's count as entry num_groups + 1 + g.
        if (g < p.num_groups && p.group_counts != nullptr && p.group_counts[g] < 0)
            return refuse(report, state, p.num_groups + 1 + g, p.group_counts[g]);
        prev = off;
    }
    return true;
}

__device__ __forceinline__ bool masked_layout_ok(const GemmParams& p, errors::ErrorReport* report, u32* state) {
    for (u32 g = 0; g < p.num_groups; ++g) {
        const i32 c = p.masked_counts[g];
        if (c < 0 || static_cast<u32>(c) > p.masked_rows) return refuse(report, state, g, c);
    }
    return true;
}

__global__ void check_group_layout(const __grid_constant__ GemmParams p, u32 block_m, u32 layout, u32* state,
                                   errors::ErrorReport* report) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const bool ok = layout == static_cast<u32>(GroupLayout::kContiguous)
                        ? contiguous_layout_ok(p, block_m, report, state)
                        : masked_layout_ok(p, report, state);
    if (ok) *state = 0;
}

}  // namespace megamoe_rt::gemm
