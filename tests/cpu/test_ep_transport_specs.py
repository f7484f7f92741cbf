"""The cross-rank kernels' variants by transport (cuda_src/ep/transport.cuh)."""

from __future__ import annotations

import pytest

from megamoe_rt.kernels import ep


def test_only_the_kernels_that_reach_other_ranks_take_the_transport():
    nvlink, nvshmem = ep.specs("int32"), ep.specs("int32", "nvshmem")
    assert set(nvshmem) == set(nvlink) | {"push"}
    for key in ("begin", "count", "send_scan", "claim"):
        assert nvshmem[key] == nvlink[key]
    for key in ("publish", "recv_layout", "dispatch", "finish"):
        assert nvlink[key].entry.endswith("<megamoe_rt::ep::PeerPointers>")
        assert nvshmem[key].entry.endswith("<megamoe_rt::ep::NvshmemApi>")
        assert nvshmem[key].device_libraries == ("nvshmem",) and not nvlink[key].device_libraries
        assert ("MEGAMOE_RT_NVSHMEM_TRANSPORT", "1") in nvshmem[key].defines
    assert ep.specs("int64")["count"].entry == "megamoe_rt::ep::ep_count<megamoe_rt::i64>"


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match=r"transport='ib': expected one of \('nvlink', 'nvshmem'\)"):
        ep.specs("int32", "ib")
