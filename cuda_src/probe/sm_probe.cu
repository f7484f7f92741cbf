// Where and when blocks run: each block records the SM it ran on (%smid) and
// %globaltimer at its start and end, after spinning for `spin_ns` so that blocks of
// concurrent kernels have a chance to overlap. Used to show that kernels bound to a
// green-context partition stay inside it.

#include "common/types.cuh"

namespace megamoe_rt::probe {

struct SmProbeParams {
    u32* smid;        // [grid]
    u64* start_ns;    // [grid]
    u64* end_ns;      // [grid]
    u64 spin_ns;
};

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u32 smid() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

__global__ void sm_probe(const __grid_constant__ SmProbeParams p) {
    if (threadIdx.x != 0) return;
    const u64 start = globaltimer_ns();
    while (globaltimer_ns() - start < p.spin_ns) {
    }
    p.smid[blockIdx.x] = smid();
    p.start_ns[blockIdx.x] = start;
    p.end_ns[blockIdx.x] = globaltimer_ns();
}

}  // namespace megamoe_rt::probe
