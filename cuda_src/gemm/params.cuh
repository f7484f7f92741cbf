// Runtime parameters of the grouped FP8 GEMM: GemmParams (mainloop and schedule), each
// epilogue's parameter struct, the group layouts and flags, and the shared-memory sizes the
// host reserves. Declared once in
// megamoe_rt/kernels/interface/gemm.py; interface/gemm.cuh is generated from it.
#pragma once

#include "common/types.cuh"
#include "interface/gemm.cuh"
