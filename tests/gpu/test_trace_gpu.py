"""``megamoe-rt trace`` on a Hopper GPU: one call of the fused and the split mode, written as a
Chrome / Perfetto trace with every SM's blocks and stages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["fused", "split"])
def test_trace_writes_every_blocks_stages(mode, tmp_path):
    path = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "megamoe_rt", "trace", "--tokens", "512", "--mode", mode, "-o", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and all(s["dur"] >= 0 and s["ts"] >= 0 for s in spans)
    names = {s["name"] for s in spans}
    assert {"count routes", "GEMM tiles", "load tiles (TMA)", "dispatch rows"} <= names
    sms = {s["args"]["sm"] for s in spans}
    if mode == "fused":
        assert "combine" in names
        assert len(sms) > 100  # one persistent block per SM of the device
    else:
        cats = {s["cat"] for s in spans}
        assert cats == {"K1 dispatch+L1", "K2 L2+scatter", "K3 reduce"}
        k1 = {s["args"]["sm"] for s in spans if s["cat"] == "K1 dispatch+L1"}
        k2 = {s["args"]["sm"] for s in spans if s["cat"] == "K2 L2+scatter"}
        assert k1 and k2 and not k1 & k2  # disjoint green partitions
    assert trace["otherData"]["mode"] == mode
    # The data waits (per block, us): sums of waits inside the call, so none exceeds the call's
    # span times the warps that add to it (the producer's one, dispatch's few).
    waits = trace["otherData"]["wait_us_per_block"]
    assert set(waits) == {"wait_rows", "wait_ring", "wait_l1_out", "wait_dispatch"}
    call_us = max(s["ts"] + s["dur"] for s in spans) - min(s["ts"] for s in spans)
    assert all(0 <= v <= 4 * call_us for v in waits.values()), (waits, call_us)
    assert waits["wait_rows"] + waits["wait_l1_out"] > 0  # L1 waits on dispatch, L2 on L1
