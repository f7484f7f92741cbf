// Reporting a refused input to the host (interface/errors.cuh). The report lies in mapped
// pinned host memory, so the host reads it without synchronising with the stream. One plain
// system-scope store per finding, no atomics: threads that find the same kind of error store
// words of the same kind, and whichever lands last is as good as any.
#pragma once

#include "common/types.cuh"
#include "interface/errors.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::errors {

// `where` keeps its low 31 bits (the host reads it back as a non-negative index).
__device__ __forceinline__ void report_error(ErrorReport* report, ErrorKind kind, u32 where, u32 what) {
    if (report == nullptr) return;
    const u64 word = kErrorRaised | (static_cast<u64>(where & 0x7fffffffu) << 32) | what;
    ptx::st_relaxed_sys_u64(&report->words[static_cast<u32>(kind)], word);
}

}  // namespace megamoe_rt::errors
