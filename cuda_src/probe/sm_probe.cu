// Where and when blocks run: each block records the SM it ran on (%smid) and
// %globaltimer at its start and end, after spinning for `spin_ns` so that blocks of
// concurrent kernels have a chance to overlap. Used to show that kernels bound to a
// green-context partition stay inside it.

#include "common/types.cuh"
#include "interface/probe.cuh"
#include "ptx/special_regs.cuh"

namespace megamoe_rt::probe {

__global__ void sm_probe(const __grid_constant__ SmProbeParams p) {
    if (threadIdx.x != 0) return;
    const u64 start = ptx::globaltimer_ns();
    while (ptx::globaltimer_ns() - start < p.spin_ns) {}
    p.smid[blockIdx.x] = ptx::smid();
    p.start_ns[blockIdx.x] = start;
    p.end_ns[blockIdx.x] = ptx::globaltimer_ns();
}

}  // namespace megamoe_rt::probe
