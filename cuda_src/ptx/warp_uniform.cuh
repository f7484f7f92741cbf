// Values the compiler can prove are the same in every lane of a warp.
//
// A value broadcast from lane 0 is warp-uniform to ptxas, so it, what is computed from it and
// loop state whose branches depend only on such values can live in the uniform datapath. That
// is what keeps the wgmma descriptors (shared-memory addresses of a stage and a warpgroup's
// rows) in uniform registers: computed from a plain threadIdx or a loaded value they sit in
// ordinary registers and are moved over (R2UR, two per 64-bit descriptor) before every wgmma,
// a dependent chain on the tensor pipe's issue path.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::ptx {

// Every lane of the warp must be present and agree on the value (only the name changes).
__device__ __forceinline__ u32 warp_uniform(u32 value) { return __shfl_sync(0xffffffffu, value, 0); }

// This thread's warpgroup (128 threads).
__device__ __forceinline__ u32 warpgroup_index_uniform() { return warp_uniform(threadIdx.x / 128); }

}  // namespace megamoe_rt::ptx
