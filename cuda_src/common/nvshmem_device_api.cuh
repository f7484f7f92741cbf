// NVSHMEM's device API for kernels compiled by NVRTC: include this instead of <nvshmem.h>.
//
// NVRTC has no C++ standard library. NVSHMEM 3.8's device headers use CCCL's cuda::std traits
// under NVRTC; up to at least 3.4 one reduction header still names std::is_integral,
// std::is_signed and std::is_unsigned, so for those versions CCCL's traits are brought into
// std here. (Those versions also declare one host-only constructor in nvshmem_tensor.h, which
// NVRTC accepts only with -default-device; megamoe_rt/jit/compiler.py passes it for every
// kernel that links NVSHMEM's device library.)
#pragma once

#include <non_abi/nvshmem_version.h>

#if defined(__CUDACC_RTC__) && (NVSHMEM_VENDOR_MAJOR_VERSION * 100 + NVSHMEM_VENDOR_MINOR_VERSION) < 308
#include <cuda/std/type_traits>
namespace std {
using cuda::std::is_integral;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
}  // namespace std
#endif

#include <nvshmem.h>
#include <nvshmemx.h>
