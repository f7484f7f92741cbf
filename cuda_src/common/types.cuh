// Fixed-width integer names for device code compiled by NVRTC without a C++
// standard library on the include path.
#pragma once

namespace megamoe_rt {

using u8 = unsigned char;
using u16 = unsigned short;
using u32 = unsigned int;
using u64 = unsigned long long;
using i32 = int;
using i64 = long long;

static_assert(sizeof(u16) == 2 && sizeof(u32) == 4 && sizeof(u64) == 8, "unexpected integer widths");

}  // namespace megamoe_rt

// Field offsets of the generated interface structs (cuda_src/interface/) are asserted where
// NVRTC evaluates offsetof in a constant expression: 13.5 does, 13.0 does not (it rejects the
// builtin). Sizes and alignments are asserted by every compiler, CI's NVRTC checks the offsets,
// and the loader compares each kernel's parameter sizes with the declarations.
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ >= 1305)
#define MEGAMOE_RT_ASSERT_OFFSET(type, field, offset, message) \
    static_assert(__builtin_offsetof(type, field) == (offset), message)
#else
#define MEGAMOE_RT_ASSERT_OFFSET(type, field, offset, message) static_assert(true, message)
#endif

namespace megamoe_rt {}  // namespace megamoe_rt
