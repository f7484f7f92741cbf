"""The unfused layer across expert-parallel ranks: what one call launches.

:class:`EpUnfusedRunner` holds what every call of one layer shares (region offsets, the
bank layout, the peer table on the device) and launches a call's cross-rank steps around
the layer's two GEMM plans (cuda_src/ep/ep_unfused.cu; the protocol is modelled in
megamoe_rt/schedule/ep_protocol.py). Inputs are copied into the symmetric ``x`` / ``x_sf`` regions,
where the ranks owning this rank's experts pull them from.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.runtime import driver
from megamoe_rt.runtime.deadlines import TimeoutRecord
from megamoe_rt.kernels import ep as ek
from megamoe_rt.kernels import moe as mk
from megamoe_rt.kernels.loader import get_kernel


def write_peer_table(buffer: Any) -> None:
    """Every rank's buffer base, as this rank maps it, into the ``peer_bases`` region."""
    import cupy

    with cupy.cuda.Device(buffer.device):
        buffer.view("peer_bases")[:] = cupy.asarray(buffer.peer_base_ptrs, dtype=cupy.uint64)
        cupy.cuda.Device(buffer.device).synchronize()


def stage_inputs(buffer: Any, xa: Any, sfa: Any, t: int, stream: int) -> None:
    """x rows and their scales into the symmetric buffer, where the ranks owning their experts
    pull them from."""
    h = buffer.layout.hidden
    driver.memcpy_2d_async(buffer.ptr("x"), h, xa.ptr, h, h, t, stream)
    driver.memcpy_2d_async(buffer.ptr("x_sf"), h // 32, sfa.ptr, h // 32, h // 32, t, stream)


class EpUnfusedRunner:
    def __init__(self, buffer: Any, *, rank: int, num_ranks: int, device: int, sm_count: int,
                 timeout_s: float | None):
        layout = buffer.layout
        if layout.num_experts > ek.MAX_EXPERTS:
            raise ValueError(f"num_experts={layout.num_experts}: at most {ek.MAX_EXPERTS} across ranks")
        self.buffer, self.layout = buffer, layout
        self.rank, self.num_ranks, self.device, self.sm_count = rank, num_ranks, device, sm_count
        self.timeout_s = timeout_s
        self.bank = ek.bank_layout(num_ranks, layout.num_local_experts)
        ws = layout.region("workspace").offset
        self.offsets = dict(off_x=layout.region("x").offset, off_x_sf=layout.region("x_sf").offset,
                            off_send_list=layout.region("send_list").offset,
                            off_combine=layout.region("combine").offset,
                            off_banks=ws + layout.workspace_region("ep_banks").offset)
        write_peer_table(buffer)
        self._kernels: dict[str, dict[str, Any]] = {}

    def kernels(self, idx: str) -> dict[str, Any]:
        if idx not in self._kernels:
            self._kernels[idx] = {k: get_kernel(s, self.device) for k, s in ek.specs(idx).items()}
        return self._kernels[idx]

    def params(self, moe: mk.MoeParams) -> ek.EpParams:
        b = self.buffer
        return ek.EpParams(
            moe=moe, peer_bases=b.ptr("peer_bases"), **self.offsets,
            send_counts=b.ptr("ep_send_counts"), send_offsets=b.ptr("ep_send_offsets"),
            send_cursors=b.ptr("ep_send_cursors"), send_list=b.ptr("send_list"), src_rows=b.ptr("ep_src_rows"),
            banks=b.ptr("ep_banks"), bank=self.bank, launch_epoch=b.ptr("launch_epoch"),
            wait=TimeoutRecord.get().context(self.timeout_s, rank=self.rank), rank=self.rank,
            num_ranks=self.num_ranks)


    def run(self, idx: str, moe: mk.MoeParams, xa: Any, sfa: Any, t: int, gemms, moe_kernels, stream: int) -> None:
        b = self.buffer
        params = self.params(moe)
        kernels = self.kernels(idx)
        stage_inputs(b, xa, sfa, t, stream)
        driver.memset_d32_async(b.ptr("ep_send_counts"), 0, self.layout.num_experts, stream)
        driver.memset_d32_async(b.ptr("ep_send_cursors"), 0, self.layout.num_experts, stream)
        driver.memset_d32_async(b.ptr("error_flags"), 0, 4, stream)
        ek.launch_before_gemms(kernels, params, pairs=t * self.layout.num_topk, pool_rows=self.layout.pool_rows,
                               sm_count=self.sm_count, stream=stream)
        for plan in gemms:
            plan.run(stream)
        ek.launch_finish(kernels, params, stream)
        if t:
            mk.launch_combine(moe_kernels, moe, mk.grids(t, self.layout.num_topk, self.sm_count), stream)
