// A kernel that calls NVSHMEM's device API, for the device-library link path: compiled with
// -rdc=true and linked with NVSHMEM's device archive by nvJitLink (megamoe_rt/jit/link.py).
// It puts one word into `peer`'s copy of `dst`, then adds 1 to `peer`'s `signal` (the fence
// orders the put before the signal, as put-with-signal would), and records whether `peer` is
// directly addressable (nvshmem_ptr), this PE's number and the PE count. No wait: a probe must
// not hang.
//
// Not nvshmem_*_put_signal*: NVRTC's uint64_t (CCCL: unsigned long long) differs from the one
// the device archive was built with (unsigned long), so the C++-mangled helper those calls reach
// does not resolve at link time (megamoe_rt/jit/link.py).

#include "common/nvshmem_device_api.cuh"
#include "common/types.cuh"

namespace megamoe_rt::probe {

__global__ void nvshmem_link_probe(int* dst, uint64_t* signal, int* out, int peer) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    out[0] = nvshmem_ptr(dst, peer) != nullptr;
    out[1] = nvshmem_my_pe();
    out[2] = nvshmem_n_pes();
    nvshmem_putmem_nbi(dst, out + 1, sizeof(int), peer);
    nvshmem_fence();
    nvshmemx_signal_op(signal, 1, NVSHMEM_SIGNAL_ADD, peer);
    nvshmem_quiet();
}

}  // namespace megamoe_rt::probe
