// Hardware named-barrier ids (bar.sync / bar.arrive), one list for every kernel: a kernel that
// includes two headers using the same id for different thread sets would deadlock or pass early.
// Id 0 is __syncthreads.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::sync {

constexpr u32 kEpilogueBarrier = 1;  // the math warpgroups of one tile exchange per-row amax (SwiGLU epilogue)
constexpr u32 kMathBarrier = 2;      // fused: the 256 math threads between a tile's stores and its post
constexpr u32 kPartialsBarrier = 3;  // fused across ranks: the relay warp tells the math warps the partials are in

}  // namespace megamoe_rt::sync
