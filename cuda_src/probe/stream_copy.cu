// A memory-bound workload for partition experiments: copy `n16` 16-byte words,
// grid-strided, several loads in flight per thread.

#include "common/types.cuh"
#include "interface/probe.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::probe {

__global__ void __launch_bounds__(256) stream_copy(const __grid_constant__ StreamCopyParams p) {
    const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
    u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < p.n16; i += 4 * stride) {
        const ptx::u32x4 a = ptx::ld_global_nc_v4_u32(p.src + i);
        const ptx::u32x4 b = ptx::ld_global_nc_v4_u32(p.src + i + stride);
        const ptx::u32x4 c = ptx::ld_global_nc_v4_u32(p.src + i + 2 * stride);
        const ptx::u32x4 d = ptx::ld_global_nc_v4_u32(p.src + i + 3 * stride);
        p.dst[i] = a;
        p.dst[i + stride] = b;
        p.dst[i + 2 * stride] = c;
        p.dst[i + 3 * stride] = d;
    }
    for (; i < p.n16; i += stride) p.dst[i] = ptx::ld_global_nc_v4_u32(p.src + i);
}

}  // namespace megamoe_rt::probe
