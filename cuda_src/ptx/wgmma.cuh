// Warpgroup MMA (wgmma) wrappers for FP8: one fixed shape, m64n128k32, e4m3 x e4m3 -> f32.
// Every GEMM tile in the project is built from this one instruction shape.
#pragma once

#include "common/types.cuh"
#include "ptx/mbarrier.cuh"

namespace megamoe_rt::ptx {

__device__ __forceinline__ void wgmma_fence_sync_aligned() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group_sync_aligned() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait_group_sync_aligned() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Shared-memory matrix descriptor for a K-major tile whose rows are exactly 128
// bytes (BLOCK_K = 128 e4m3) written by TMA with 128-byte swizzle: core matrices of
// 8 rows x 16 bytes, 8-row groups 1024 bytes apart (SBO), leading offset unused.
// The tile base must be 1024-byte aligned so the swizzle phase is zero.
__device__ __forceinline__ u64 smem_desc_k_major_sw128(const void* tile) {
    const u64 addr = smem_addr_u32(tile);
    u64 desc = (addr & 0x3FFFFull) >> 4;        // start address, 16-byte units
    desc |= static_cast<u64>(1) << 16;          // leading byte offset (ignored for this mode)
    desc |= static_cast<u64>(1024 >> 4) << 32;  // stride byte offset
    desc |= static_cast<u64>(1) << 62;          // 128-byte swizzle
    return desc;
}

// Advances a descriptor along K inside the 128-byte swizzled row: the hardware
// applies the swizzle to absolute address bits, so a k-step is a plain offset.
__device__ __forceinline__ u64 smem_desc_advance_bytes(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// D[64x128] (+)= A[64x32] . B[128x32]^T; A and B K-major in shared memory.
// Fragment of D held by thread t of the warpgroup (warp w = t/32, lane l):
// d[4i + 0/1] = row 16w + l/4,     cols 8i + 2(l%4) + 0/1
// d[4i + 2/3] = row 16w + l/4 + 8, same cols                     (i = 0..15)
__device__ __forceinline__ void wgmma_m64n128k32_f32_e4m3_e4m3(float (&d)[64], u64 desc_a, u64 desc_b,
                                                               bool accumulate) {
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %66, 0;\n"
        "  wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
        "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, "
        "1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
          "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
          "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<u32>(accumulate)));
}

}  // namespace megamoe_rt::ptx
