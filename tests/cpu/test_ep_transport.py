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


def test_transport_choices_are_checked():
    from megamoe_rt.modes.base import check_transport

    assert [check_transport(t, 2) for t in ("auto", "nvlink", "nvshmem")] == ["auto", "nvlink", "nvshmem"]
    assert check_transport("auto", 1) == "auto"
    with pytest.raises(ValueError, match=r"transport: expected one of \('auto', 'nvlink', 'nvshmem'\), got 'ib'"):
        check_transport("ib", 2)
    with pytest.raises(ValueError, match="transport: expected one of"):
        check_transport(None, 2)
    with pytest.raises(ValueError, match="one rank\\) has no other rank to reach"):
        check_transport("nvshmem", 1)


def test_the_nvshmem_transport_stages_partials_in_a_region_of_its_own():
    from megamoe_rt.modes.base import LayerSpec, LayoutNeeds, buffer_layout
    from megamoe_rt.schedule.layout import symm_buffer_layout

    needs = LayoutNeeds(pool="full", block_m=128)
    nvlink = buffer_layout(LayerSpec(512, 256, 16, 4, 1000, num_ranks=2), needs)
    nvshmem = buffer_layout(LayerSpec(512, 256, 16, 4, 1000, num_ranks=2, transport="nvshmem"), needs)
    assert "ep_staging" not in {r.name for r in nvlink.regions}
    staging = nvshmem.region("ep_staging")
    assert staging.dtype == "bf16" and staging.shape == (nvshmem.pool_rows, 512)
    assert nvshmem.total_bytes >= nvlink.total_bytes + nvshmem.pool_rows * 512 * 2
    with pytest.raises(ValueError, match="ep_staging: staging rows carry partials to other ranks"):
        symm_buffer_layout(512, 256, 16, 4, 1000, 1, ep_staging=True)


def test_only_the_unfused_mode_runs_over_nvshmem():
    from megamoe_rt.modes.base import LayerSpec
    from megamoe_rt.modes.fused import FusedMode
    from megamoe_rt.modes.registry import select_mode
    from megamoe_rt.modes.split import SplitMode
    from megamoe_rt.modes.unfused import UnfusedMode

    spec = LayerSpec(512, 256, 16, 4, 1000, num_ranks=2, transport="nvshmem")
    assert "mode='fused' reaches other ranks through peer pointers only" in FusedMode.refusal(spec)
    assert "mode='split' reaches other ranks through peer pointers only" in SplitMode.refusal(spec)
    assert UnfusedMode.refusal(spec) is None
    assert select_mode(None, spec) is UnfusedMode
    with pytest.raises(ValueError, match="transport='nvshmem': mode='fused'"):
        select_mode("fused", spec)


@pytest.mark.parametrize("transport", ["nvlink", "nvshmem"])
def test_across_ranks_each_window_is_pushed_after_its_gemms_only_over_nvshmem(monkeypatch, transport):
    from megamoe_rt.kernels import ep as ek
    from megamoe_rt.modes import base, unfused
    from megamoe_rt.modes.base import Call, LayerSpec, buffer_layout
    from megamoe_rt.modes.unfused import UnfusedMode
    from megamoe_rt.runtime.deadlines import TimeoutRecord
    from tests.cpu.test_modes import AddressOnlyBuffer

    record = TimeoutRecord.__new__(TimeoutRecord)  # the deadline record without host memory
    record.device_ptr = 0
    monkeypatch.setattr(TimeoutRecord, "_instance", record)
    monkeypatch.setattr(base, "write_peer_table", lambda buffer: None)
    spec = LayerSpec(512, 256, 16, 4, 1000, num_ranks=2, rank=1, transport=transport, sm_count=132)
    ring = UnfusedMode.minimum_ring_blocks(spec) + 1
    layout = buffer_layout(spec, UnfusedMode.layout_needs(spec, ring))
    mode = UnfusedMode(spec, layout)
    mode.bind(AddressOnlyBuffer(layout, spec.rank))
    cycles = mode.cycles_to_launch(1000)
    assert cycles >= 2, "a ring smaller than the pool: several windows"
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(mode, "ep_kernels", lambda idx: {})
    monkeypatch.setattr(mode, "moe_kernels", lambda idx: {})
    for name in ("launch_routing", "launch_pull", "launch_push", "launch_finish"):
        monkeypatch.setattr(ek, name, lambda *a, name=name, **kw: log.append((name, a[1].moe.row_base, a[1].staging)))
    monkeypatch.setattr(mode, "_gemms_over_window", lambda row_base, q: log.append(("gemms", row_base, None)))
    monkeypatch.setattr(unfused.mk, "launch_combine", lambda *a, **kw: log.append(("combine", 0, None)))

    class Memsets:  # the call's Launches: the memsets are all that reach it here
        def kernel(self, *a, **kw):
            raise AssertionError("every kernel launch goes through the launch helpers")

        def memset_u32(self, ptr, value, count):
            pass

    call = Call(100, 0x1000, 0x2000, 0x3000, 0x4000, 100, "int32", 1000)
    mode._run_across_ranks(call, Memsets(), (0, 0))
    staging = mode.buffer.ptr("ep_staging") if transport == "nvshmem" else 0
    rows = layout.pool_rows
    window = [("launch_pull", None), ("gemms", None)] + ([("launch_push", None)] if transport == "nvshmem" else [])
    expected = [("launch_routing", 0)]
    for c in range(cycles):
        expected += [(name, c * rows) for name, _ in window]
    expected += [("launch_finish", 0), ("combine", 0)]
    assert [(name, rb) for name, rb, _ in log] == expected
    assert {s for name, _, s in log if name.startswith("launch")} == {staging}


def test_a_peer_on_another_node_reads_as_unmapped_not_as_an_error(monkeypatch):
    """nvshmem_ptr is null for a peer this rank cannot load from (another node): the runtime
    must see 0 there (auto then picks the NVSHMEM transport), where nvshmem4py's
    get_peer_buffer would raise."""
    from types import SimpleNamespace

    import nvshmem.bindings

    from megamoe_rt.ep import symm

    # Rank 0 of 3 maps rank 1 (same node) but not rank 2.
    monkeypatch.setattr(nvshmem.bindings, "ptr", lambda local, pe: 0 if pe == 2 else local + (pe << 32))
    assert symm.peer_address(0x1000, 1) == 0x1000 + (1 << 32)
    assert symm.peer_address(0x1000, 2) == 0

    freed = []
    rt = object.__new__(symm.NvshmemRuntime)
    rt.rank, rt.world_size = 0, 3
    rt._nvshmem = SimpleNamespace(buffer=lambda n: SimpleNamespace(handle=0x1000), free=freed.append)
    seen = []

    def allgather(value, *, key):
        seen.append(value)
        return [value, b"1", b"1"]  # the other ranks map everyone they see

    rt.ctx = SimpleNamespace(allgather=allgather)
    assert rt.every_peer_mapped() is False
    assert seen == [b"0"] and len(freed) == 1  # the probe is freed (collective) whatever the answer
