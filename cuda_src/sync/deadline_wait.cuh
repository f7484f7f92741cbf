// Spin-waits on signal words with a deadline. A wait that outlives its deadline leaves the
// loop, prints which wait it was (site, block, rank, peer, expected and seen values) and
// traps: a hang becomes a diagnosed failure.
//
// The report runs after the loop, not from inside it, so the loop stays small and kernels
// that also run wgmma keep their register plan. Every report leaves a TimeoutRecord for the
// host; only kernels without wgmma also printf (a call serialises the wgmma pipeline).
//
// WaitSite with its messages (wait_site_name), WaitContext and TimeoutRecord are declared in
// megamoe_rt/kernels/interface/sync.py, generated into interface/sync.cuh.
#pragma once

#include "common/types.cuh"
#include "interface/sync.cuh"
#include "ptx/ld_st.cuh"
#include "ptx/special_regs.cuh"
#include "sync/timeout_record.cuh"

namespace megamoe_rt::sync {

// Record the failure for the host and stop the kernel. No call: usable in wgmma kernels.
__device__ __forceinline__ void fail_wait(WaitSite site, const WaitContext& ctx, u32 peer, u64 expected, u64 seen,
                                          u64 elapsed_ns) {
    write_timeout_record(ctx.record, static_cast<u32>(site), ctx.rank, peer, expected, seen, elapsed_ns);
    __trap();
}

// Prints the wait's line once per launch, not once per timed-out thread: only the thread
// that claims the record prints; the others hold back their trap until the line is written.
__device__ __noinline__ void report_wait_timeout(WaitSite site, const WaitContext& ctx, u32 peer, u64 expected,
                                                 u64 seen) {
    if (claim_timeout_record(ctx.record)) {
        printf(
            "megamoe_rt: wait '%s' timed out after %.1f s: block %u thread %u, rank %u, peer %u, "
            "expected >= %llu, saw %llu\n",
            wait_site_name(site), static_cast<double>(ctx.timeout_ns) * 1e-9, blockIdx.x, threadIdx.x, ctx.rank, peer,
            static_cast<unsigned long long>(expected), static_cast<unsigned long long>(seen));
        fill_timeout_record(ctx.record, static_cast<u32>(site), ctx.rank, peer, expected, seen, ctx.timeout_ns);
    } else {
        await_timeout_record(ctx.record);
    }
    __trap();
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* word) { return ptx::ld_acquire_sys_u64(word); }
__device__ __forceinline__ u32 ld_acquire_sys(const u32* word) { return ptx::ld_acquire_sys_u32(word); }

// Waits until *word >= expected (acquire, system scope: a peer rank's store over NVLink)
// and returns the value seen. Kernels without wgmma only: the report prints.
template <typename Word>
__device__ __forceinline__ Word wait_ge_acquire_sys(const Word* word, Word expected, WaitSite site,
                                                    const WaitContext& ctx, u32 peer) {
    const u64 start = ptx::globaltimer_ns();
    Word seen = ld_acquire_sys(word);
    u32 spins = 0;
    bool expired = false;
    while (seen < expected) {
        // Read the clock only every 256 polls: the timer read is slower than the load.
        if ((++spins & 255u) == 0 && ptx::globaltimer_ns() - start > ctx.timeout_ns) {
            expired = true;
            break;
        }
        seen = ld_acquire_sys(word);
    }
    if (expired) report_wait_timeout(site, ctx, peer, expected, seen);
    return seen;
}

__device__ __forceinline__ u64 wait_ge_acquire_sys_u64(const u64* word, u64 expected, WaitSite site,
                                                       const WaitContext& ctx, u32 peer) {
    return wait_ge_acquire_sys(word, expected, site, ctx, peer);
}

__device__ __forceinline__ u32 wait_ge_acquire_sys_u32(const u32* word, u32 expected, WaitSite site,
                                                       const WaitContext& ctx, u32 peer) {
    return wait_ge_acquire_sys(word, expected, site, ctx, peer);
}

// Waits until `done(*word)` (acquire, GPU scope) and returns the value seen; on timeout
// records and traps without a call (wgmma kernels). `expected` is only for the report.
// `deadline_shift`: waits that can only be stuck because another wait is give themselves
// 2^shift times the deadline, so the first report names the root cause, not a bystander.
template <class Done>
__device__ __forceinline__ u32 wait_acquire_gpu_u32(const u32* word, Done done, u64 expected, WaitSite site,
                                                    const WaitContext& ctx, u32 peer, u32 deadline_shift = 0) {
    const u64 timeout_ns = ctx.timeout_ns << deadline_shift;
    u32 seen = ptx::ld_acquire_gpu_u32(word);
    if (done(seen)) return seen;
    const u64 start = ptx::globaltimer_ns();
    u64 elapsed = 0;
    u32 spins = 0;
    while (!done(seen)) {
        if ((++spins & 255u) == 0) {
            elapsed = ptx::globaltimer_ns() - start;
            if (elapsed > timeout_ns) break;
        }
        // Back off: a polling thread shares its SM's issue slots with the math warps.
        if (spins > 8) __nanosleep(64);
        seen = ptx::ld_acquire_gpu_u32(word);
    }
    if (!done(seen)) fail_wait(site, ctx, peer, expected, seen, elapsed);
    return seen;
}

__device__ __forceinline__ u32 wait_ge_acquire_gpu_u32(const u32* word, u32 expected, WaitSite site,
                                                       const WaitContext& ctx, u32 peer = 0, u32 deadline_shift = 0) {
    return wait_acquire_gpu_u32(
        word, [expected](u32 v) { return v >= expected; }, expected, site, ctx, peer, deadline_shift);
}

// Waits until *word >= expected (acquire, system scope: a peer rank's store, or a producer
// kernel's on this GPU) in a kernel that cannot printf (wgmma): on timeout it records and
// traps, like wait_acquire_gpu_u32.
template <typename Word>
__device__ __forceinline__ Word wait_ge_acquire_sys_quiet(const Word* word, Word expected, WaitSite site,
                                                          const WaitContext& ctx, u32 peer, u32 deadline_shift) {
    const u64 timeout_ns = ctx.timeout_ns << deadline_shift;
    Word seen = ld_acquire_sys(word);
    if (seen >= expected) return seen;
    const u64 start = ptx::globaltimer_ns();
    u64 elapsed = 0;
    u32 spins = 0;
    while (seen < expected) {
        if ((++spins & 255u) == 0) {
            elapsed = ptx::globaltimer_ns() - start;
            if (elapsed > timeout_ns) break;
        }
        if (spins > 8) __nanosleep(64);
        seen = ld_acquire_sys(word);
    }
    // The trap stays out of the loop (see the header comment).
    if (seen < expected) fail_wait(site, ctx, peer, expected, seen, elapsed);
    return seen;
}

__device__ __forceinline__ u32 wait_ge_acquire_sys_u32_quiet(const u32* word, u32 expected, WaitSite site,
                                                             const WaitContext& ctx, u32 peer, u32 deadline_shift = 0) {
    return wait_ge_acquire_sys_quiet(word, expected, site, ctx, peer, deadline_shift);
}

__device__ __forceinline__ u64 wait_ge_acquire_sys_u64_quiet(const u64* word, u64 expected, WaitSite site,
                                                             const WaitContext& ctx, u32 peer, u32 deadline_shift = 0) {
    return wait_ge_acquire_sys_quiet(word, expected, site, ctx, peer, deadline_shift);
}

// Deadline shifts of derived waits (see wait_acquire_gpu_u32).
constexpr u32 kDerivedWaitShift = 1;     // waits on work that itself waits (published L1 output, freed slots)
constexpr u32 kBarrierWaitShift = 2;     // grid barriers: downstream of everything
constexpr u32 kPeerStallShift = 3;       // a peer's end of launch: behind its own grid barriers
constexpr u32 kIntraBlockWaitShift = 4;  // mbarrier waits of kernels that also wait across blocks

}  // namespace megamoe_rt::sync
