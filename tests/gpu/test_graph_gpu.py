"""Green-context partitions and partition-bound graph nodes on the GPU (needs a Hopper GPU).

The probe kernel records %smid and %globaltimer per block; a partition holds if every
block of a node ran on at most the partition's SM count of distinct SMs and two nodes in
disjoint partitions used disjoint SM sets."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

GRID = 512
SPIN_NS = 300_000


def _probe_buffers(n):
    return cp.zeros(n, cp.uint32), cp.zeros(n, cp.uint64), cp.zeros(n, cp.uint64)


def _args(bufs, spin=SPIN_NS):
    from megamoe_rt.kernels.probe import SmProbeParams

    smid, start, end = bufs
    return [SmProbeParams(int(smid.data.ptr), int(start.data.ptr), int(end.data.ptr), spin)]


def _kernel():
    from megamoe_rt.kernels.loader import get_kernel
    from megamoe_rt.kernels.probe import SPEC
    from megamoe_rt.runtime import driver

    return get_kernel(SPEC, driver.current_device())


def test_partition_granularity_is_queried_and_splits_match():
    from megamoe_rt.graph.green import GreenPartitions, partition_granularity
    from megamoe_rt.runtime import devices

    g = partition_granularity(0)
    assert g == 8  # Hopper
    sms = devices.device_info(0).sm_count
    with GreenPartitions([("a", 64), ("b", "rest")]) as parts:
        # "rest" is every SM the 64 leave.
        assert parts["a"].sm_count == 64 and parts["b"].sm_count == sms - 64 and parts.remainder_sms == 0
    with GreenPartitions([("x", 64), ("y", 64)]) as parts:
        assert parts["x"].sm_count == parts["y"].sm_count == 64 and parts.remainder_sms == sms - 128


def test_graph_nodes_stay_in_their_partitions_and_overlap():
    from megamoe_rt.graph.builder import GraphBuilder
    from megamoe_rt.graph.green import GreenPartitions

    k = _kernel()
    left, right = _probe_buffers(GRID), _probe_buffers(GRID)
    with GreenPartitions([("left", 64), ("right", 64)]) as parts:
        g = GraphBuilder()
        g.add_kernel(k, (GRID,), (32,), _args(left), ctx=parts["left"].ctx)
        g.add_kernel(k, (GRID,), (32,), _args(right), ctx=parts["right"].ctx)
        g.instantiate()
        stream = cp.cuda.Stream(non_blocking=True)
        g.launch(stream.ptr)
        stream.synchronize()
        g.close()
    sm_l, sm_r = set(cp.asnumpy(left[0]).tolist()), set(cp.asnumpy(right[0]).tolist())
    assert len(sm_l) <= 64 and len(sm_r) <= 64, (len(sm_l), len(sm_r))
    assert not (sm_l & sm_r)
    # Without a dependency the two nodes run at the same time.
    s_l, e_l = int(cp.asnumpy(left[1]).min()), int(cp.asnumpy(left[2]).max())
    s_r, e_r = int(cp.asnumpy(right[1]).min()), int(cp.asnumpy(right[2]).max())
    overlap = min(e_l, e_r) - max(s_l, s_r)
    assert overlap > 0.5 * min(e_l - s_l, e_r - s_r), (s_l, e_l, s_r, e_r)
    print(
        f"left used {len(sm_l)} SMs, right {len(sm_r)} SMs, overlap {overlap / 1e3:.0f} us of "
        f"{(e_l - s_l) / 1e3:.0f}/{(e_r - s_r) / 1e3:.0f} us"
    )


def test_dependency_serialises_and_params_update_between_replays():
    from megamoe_rt.graph.builder import GraphBuilder
    from megamoe_rt.graph.green import GreenPartitions

    k = _kernel()
    first, second, other = _probe_buffers(64), _probe_buffers(64), _probe_buffers(64)
    with GreenPartitions([("a", 32), ("b", 32)]) as parts:
        g = GraphBuilder()
        n1 = g.add_kernel(k, (64,), (32,), _args(first, 50_000), ctx=parts["a"].ctx)
        g.add_kernel(k, (64,), (32,), _args(second, 50_000), ctx=parts["b"].ctx, deps=[n1])
        g.instantiate()
        g.launch()
        cp.cuda.Device().synchronize()
        assert int(cp.asnumpy(second[1]).min()) >= int(cp.asnumpy(first[2]).max())
        g.update_kernel(n1, _args(other, 10_000))
        g.launch()
        cp.cuda.Device().synchronize()
        g.close()
    assert (cp.asnumpy(other[2]) > 0).all()
    assert len(set(cp.asnumpy(other[0]).tolist())) <= 32


def test_stream_capture_from_a_green_context_stream_keeps_the_partition():
    from cuda.bindings import driver as cu

    from megamoe_rt.graph.green import GreenPartitions
    from megamoe_rt.runtime import driver

    k = _kernel()
    bufs = _probe_buffers(GRID)
    with GreenPartitions([("p", 16), ("q", "rest")]) as parts:
        s = parts["p"].stream
        driver.call(cu.cuStreamBeginCapture, s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        k.launch((GRID,), (32,), _args(bufs, 20_000), stream=int(s), in_stream_context=True)
        graph = driver.call(cu.cuStreamEndCapture, s)
        exe = driver.call(cu.cuGraphInstantiate, graph, 0)
        driver.call(cu.cuGraphLaunch, exe, int(s))
        driver.call(cu.cuStreamSynchronize, s)
        driver.call(cu.cuGraphExecDestroy, exe)
        driver.call(cu.cuGraphDestroy, graph)
    used = set(cp.asnumpy(bufs[0]).tolist())
    assert 0 < len(used) <= 16, len(used)


def test_sweep_runs_a_spec_across_splits(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "graphs" / "membound_vs_gemm.toml"
    out_json = tmp_path / "sweep.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamoe_rt",
            "sweep",
            "--spec",
            str(spec),
            "--vary",
            "gemm=32..64:32",
            "--reps",
            "3",
            "-o",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["value"] for r in rows] == [32, 64]
    for r in rows:
        assert r["partitions"]["gemm"] == r["value"]
        assert r["total_us"] > 0 and all(t > 0 for t in r["nodes_us"].values())
    # More SMs for the GEMM make it faster.
    assert rows[1]["nodes_us"]["gemm"] < rows[0]["nodes_us"]["gemm"]
    print(run.stdout)


def test_memset_node_runs_before_its_dependent_kernel():
    from megamoe_rt.graph.builder import GraphBuilder
    from megamoe_rt.graph.green import GreenPartitions

    k = _kernel()
    target = cp.zeros(4096, cp.uint32)
    bufs = _probe_buffers(32)
    with GreenPartitions([("a", 32), ("b", 32)]) as parts:
        g = GraphBuilder()
        m = g.add_memset_u32(int(target.data.ptr), 0xA5A5F00D, target.size, ctx=parts["a"].ctx)
        g.add_kernel(k, (32,), (32,), _args(bufs, 1_000), ctx=parts["b"].ctx, deps=[m])
        g.instantiate()
        g.launch()
        cp.cuda.Device().synchronize()
        g.close()
    assert (cp.asnumpy(target) == 0xA5A5F00D).all()
    assert (cp.asnumpy(bufs[2]) > 0).all()


@pytest.mark.parametrize(
    "requests,fine",
    [
        ([("k1", 96), ("k2", 32)], False),  # 96 off the device, 32 off the 36 left
        ([("k1", 96), ("k2", "rest")], False),
        ([("k1", 80), ("k2", 40), ("k3", "rest")], False),
        ([("k1", 100), ("k2", "rest")], True),  # without SM co-scheduling: pairs of SMs
    ],
)
def test_unequal_splits_form_and_confine_their_kernels(requests, fine):
    from cuda.bindings import driver as cu

    from megamoe_rt.graph.green import GreenPartitions
    from megamoe_rt.runtime import devices, driver

    sms = devices.device_info(0).sm_count
    k = _kernel()
    with GreenPartitions(requests, fine=fine) as parts:
        sizes = {n: p.sm_count for n, p in parts.partitions.items()}
        fixed = {n: r for n, r in requests if r != "rest"}
        assert all(sizes[n] == r for n, r in fixed.items()), sizes
        if any(r == "rest" for _, r in requests):
            assert sum(sizes.values()) == sms and parts.remainder_sms == 0, sizes
        for name, part in parts.partitions.items():
            bufs = _probe_buffers(GRID)
            k.launch((GRID,), (32,), _args(bufs, 20_000), stream=part.stream_handle, in_stream_context=True)
            driver.call(cu.cuStreamSynchronize, part.stream)
            used = set(cp.asnumpy(bufs[0]).tolist())
            assert 0 < len(used) <= part.sm_count, (name, len(used), part.sm_count)


def test_a_split_the_device_cannot_form_lists_what_it_can():
    from megamoe_rt.graph.green import GreenPartitions

    with pytest.raises(ValueError, match="not a positive multiple of 8; valid counts on this device: 8, 16"):
        GreenPartitions([("k1", 100), ("k2", "rest")])


def test_the_split_table_says_what_a_first_partition_can_be():
    from megamoe_rt.graph.green import split_table

    coarse = {asked: granted for asked, granted, _ in split_table(0)}
    assert coarse[96] == 96 and coarse[8] == 8 and coarse[100] == 104  # rounded up to a multiple of 8
    fine = {asked: (granted, left) for asked, granted, left in split_table(0, fine=True)}
    assert fine[100] == (100, 32) and fine[2][0] == 2
