// Global-memory load/store wrappers named after the instruction they emit.
#pragma once

#include "common/types.cuh"

namespace megamoe_rt::ptx {

struct u32x4 {
    u32 x, y, z, w;
};
struct u32x2 {
    u32 x, y;
};

// Read-only (non-coherent) 16-byte load: only for data no thread of this
// launch writes.
__device__ __forceinline__ u32x4 ld_global_nc_v4_u32(const void* ptr) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// 16-byte load cached in L2 only (not L1): for data other blocks or a producer may rewrite
// while this launch runs, once an acquire has ordered the rewrite before it.
__device__ __forceinline__ u32x4 ld_global_cg_v4_u32(const void* ptr) {
    u32x4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ float ld_global_cg_f32(const float* ptr) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
    return v;
}

__device__ __forceinline__ void st_global_v4_b32(void* ptr, u32x4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void st_global_v2_u32(void* ptr, u32x2 v) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(ptr), "r"(v.x), "r"(v.y) : "memory");
}

__device__ __forceinline__ void st_global_f32(float* ptr, float v) {
    asm volatile("st.global.f32 [%0], %1;" ::"l"(ptr), "f"(v) : "memory");
}

}  // namespace megamoe_rt::ptx

namespace megamoe_rt::ptx {

__device__ __forceinline__ void st_global_b32(void* ptr, u32 v) {
    asm volatile("st.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_global_b16(void* ptr, u16 v) {
    asm volatile("st.global.b16 [%0], %1;" ::"l"(ptr), "h"(v) : "memory");
}

__device__ __forceinline__ float ld_global_nc_f32(const float* ptr) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
    return v;
}

__device__ __forceinline__ i32 ld_global_nc_s32(const i32* ptr) {
    i32 v;
    asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(ptr));
    return v;
}

__device__ __forceinline__ u64 ld_global_nc_u64(const u64* ptr) {
    u64 v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(ptr));
    return v;
}

}  // namespace megamoe_rt::ptx

namespace megamoe_rt::ptx {

// Cross-rank / cross-block signal words. Scope and order are in the names: `sys` reaches
// peers over NVLink and the host, `gpu` other blocks of this GPU.

__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64* ptr) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ u32 ld_acquire_sys_u32(const u32* ptr) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys_u32(u32* ptr, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ u32 ld_acquire_gpu_u32(const u32* ptr) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys_u64(u64* ptr, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// A report word the host polls (mapped pinned memory): no ordering with anything else is needed.
__device__ __forceinline__ void st_relaxed_sys_u64(u64* ptr, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void red_release_sys_add_u64(u64* ptr, u64 v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void red_release_gpu_add_u32(u32* ptr, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

}  // namespace megamoe_rt::ptx

namespace megamoe_rt::ptx {

// Block-to-block signalling inside one GPU (the fused kernel's counters and grid barrier).

// Peers fold a value into one word; the word is read only after a later release/acquire
// handshake with every peer, so the reduction itself needs no ordering.
__device__ __forceinline__ void red_relaxed_sys_max_u32(u32* ptr, u32 v) {
    asm volatile("red.relaxed.sys.global.max.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ u32 ld_relaxed_gpu_u32(const u32* ptr) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void st_relaxed_gpu_u32(u32* ptr, u32 v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu_u32(u32* ptr, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ u32 atom_add_acq_rel_gpu_u32(u32* ptr, u32 v) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

// Orders this thread's generic-proxy global accesses with async-proxy (TMA) accesses:
// rows written with st.global and later loaded by TMA need it on both sides of the flag.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace megamoe_rt::ptx
