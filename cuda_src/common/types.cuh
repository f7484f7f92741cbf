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
