// Dispatch: one warp per (token, slot). A routed pair claims the next row of its
// expert's pool range, writes the row's metadata (source pair, top-k weight, the address its L2
// output goes to: its combine slot) and copies the token's e4m3 row and its scales there
// (scales k-block-major, the layout the L1 GEMM's TMA reads).
//
// With a ring (pool_rows below the rows laid out) the rows past the first window get their
// metadata now and their data later: moe_fill_window copies window c (pool rows
// [c * pool_rows, (c + 1) * pool_rows)) into the ring before cycle c's GEMMs.
//
// Row order inside an expert follows the atomic claims and may differ between
// runs; every output depends only on its own row, so results do not.

#include "common/types.cuh"
#include "moe/params.cuh"
#include "moe/pool_row.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::moe {

template <typename IdxT>
__global__ void __launch_bounds__(kDispatchThreads) moe_dispatch(const __grid_constant__ MoeParams p) {
    const u32 lane = threadIdx.x % 32;
    const u32 warps = gridDim.x * (kDispatchThreads / 32);
    const u32 pairs = p.num_tokens * p.num_topk;
    for (u32 pair = (blockIdx.x * kDispatchThreads + threadIdx.x) / 32; pair < pairs; pair += warps) {
        i32 row = -1;
        if (lane == 0) {
            const i32 e = local_expert<IdxT>(p, pair);
            if (e >= 0) {
                row = p.expert_offsets[e] + atomicAdd(&p.expert_cursors[e], 1);
                if (static_cast<u32>(row) >= p.pool_row_limit) {
                    errors::report_error(p.errors, errors::ErrorKind::kPoolOverflow, static_cast<u32>(row) + 1,
                                         p.pool_row_limit);
                    row = -1;
                }
            }
        }
        row = __shfl_sync(0xFFFFFFFFu, row, 0);
        if (row < 0) continue;
        const u32 token = pair / p.num_topk;
        const u32 slot = pair % p.num_topk;
        if (static_cast<u32>(row) < p.pool_rows) copy_token_row(p, token, static_cast<u32>(row), lane);
        if (lane == 0) {
            p.pool_src[row] = static_cast<i32>(pair);
            p.pool_weight[row] = p.topk_weights[pair];
            p.pool_dst[row] = reinterpret_cast<u64>(p.combine) +
                              (static_cast<u64>(slot) * p.token_capacity + token) * p.hidden * 2ull;
        }
    }
}

// One warp per data row of the ring: pool row row_base + i (metadata written by moe_dispatch)
// into data row i. Padding rows and rows past the laid-out pool are left alone (no GEMM tile
// reads them into an output).
__global__ void __launch_bounds__(kDispatchThreads) moe_fill_window(const __grid_constant__ MoeParams p) {
    const u32 lane = threadIdx.x % 32;
    const u32 warps = gridDim.x * (kDispatchThreads / 32);
    const u32 el = p.num_local_experts;
    const u32 laid_out = static_cast<u32>(p.expert_offsets[el]);
    for (u32 i = (blockIdx.x * kDispatchThreads + threadIdx.x) / 32; i < p.pool_rows; i += warps) {
        const u32 row = p.row_base + i;
        if (row >= laid_out) break;  // warps walk i upwards: every later row is past the end too
        const u32 e = expert_of_row(p, row);
        if (row >= static_cast<u32>(p.expert_offsets[e] + p.expert_counts[e])) continue;  // padding
        copy_token_row(p, static_cast<u32>(p.pool_src[row]) / p.num_topk, i, lane);
    }
}

}  // namespace megamoe_rt::moe
