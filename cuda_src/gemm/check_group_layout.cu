// Device-side check of a grouped GEMM's group layout (offsets and counts live on
// the GPU, so the host cannot read them without a sync). One thread walks the
// arrays and traps with a message naming the bad entry. Launched on the GEMM's
// stream just before it, so a violated contract stops the GEMM instead of
// letting it read or write outside the groups.

#include "common/types.cuh"
#include "gemm/params.cuh"

namespace megamoe_rt::gemm {

__global__ void check_group_layout(const __grid_constant__ GemmParams p, u32 block_m, u32 layout) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (layout == static_cast<u32>(GroupLayout::kContiguous)) {
        i32 prev = 0;
        for (u32 g = 0; g <= p.num_groups; ++g) {
            const i32 off = p.group_offsets[g];
            if (off < prev || off % static_cast<i32>(block_m) != 0 || static_cast<u32>(off) > p.num_rows) {
                printf(
                    "megamoe_rt grouped GEMM: group_offsets[%u] = %d is invalid (must be non-decreasing, "
                    "a multiple of %u and <= %u rows)\n",
                    g, off, block_m, p.num_rows);
                __trap();
            }
            if (g < p.num_groups && p.group_counts != nullptr && p.group_counts[g] < 0) {
                printf("megamoe_rt grouped GEMM: group_counts[%u] = %d is negative\n", g, p.group_counts[g]);
                __trap();
            }
            prev = off;
        }
    } else {
        for (u32 g = 0; g < p.num_groups; ++g) {
            const i32 c = p.masked_counts[g];
            if (c < 0 || static_cast<u32>(c) > p.masked_rows) {
                printf("megamoe_rt grouped GEMM: masked_counts[%u] = %d is outside [0, %u]\n", g, c, p.masked_rows);
                __trap();
            }
        }
    }
}

}  // namespace megamoe_rt::gemm
