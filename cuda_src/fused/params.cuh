// Parameters of the fused MoE kernel: FusedParams, BankLayout, TraceEvent, the tile and the
// shared-memory sizes, declared in megamoe_rt/kernels/interface/fused.py and generated into
// interface/fused.cuh. Every pointer, stride and size is resolved on the host.
#pragma once

#include "common/types.cuh"
#include "ep/params.cuh"
#include "gemm/params.cuh"
#include "interface/fused.cuh"
#include "moe/params.cuh"
#include "sync/deadline_wait.cuh"
#include "sync/grid_barrier.cuh"
