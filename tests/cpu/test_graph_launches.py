"""GraphLaunches on the CPU, the driver stood in for: the first call records the launches as a
chain of graph nodes; later calls rewrite only nodes whose grid or arguments changed, bring the
built-from graph up to date only when a capture copies it, and refuse a different sequence."""

from __future__ import annotations

import ctypes

import pytest

from megamoe_rt.graph import launches as gl


class _Builder:
    def __init__(self, log):
        self.log, self.n = log, 0
        self.contexts: list = []

    def _node(self):
        self.n += 1
        return gl.KernelNode(self.n, None, None, [])

    def add_kernel(self, kernel, grid, block, args, *, deps=(), ctx=None):
        node = self._node()
        self.contexts.append(ctx)
        self.log.append(("add", kernel, grid, [bytes(a) for a in args], [d for d in deps]))
        return node

    def add_memset_u32(self, ptr, value, count, *, deps=(), ctx=None):
        self.n += 1
        self.contexts.append(ctx)
        self.log.append(("memset", ptr, value, count, list(deps)))
        return self.n

    def instantiate(self):
        self.log.append(("instantiate",))

    def update_kernel(self, node, args, *, grid=None, template=True):
        self.log.append(("update", node.node, grid, [bytes(a) for a in args], template))

    def update_template(self, node):
        self.log.append(("template", node.node))

    def launch(self, stream):
        self.log.append(("launch", stream))

    def add_to_capture(self, stream):
        self.log.append(("capture", stream))


@pytest.fixture
def graph(monkeypatch):
    log: list = []
    capturing: set[int] = set()
    monkeypatch.setattr(gl, "GraphBuilder", lambda: _Builder(log))
    monkeypatch.setattr(gl.streams, "stream_is_capturing", lambda s: s in capturing)
    return gl.GraphLaunches(), log, capturing


A, B = object(), object()


def _call(g, x, grid=2, stream=7):
    g.begin()
    g.memset_u32(0x1000, 0, 16)
    g.kernel(A, (grid,), (128,), [ctypes.c_uint64(x)])
    g.kernel(B, (1,), (32,), [ctypes.c_uint32(5)])
    g.end(stream)


def test_the_first_call_records_a_chain_and_launches_it(graph):
    g, log, _ = graph
    _call(g, 11)
    assert [e[0] for e in log] == ["memset", "add", "add", "instantiate", "launch"]
    assert log[0][4] == [] and log[1][4] == [1] and log[2][4] == [2]  # each node after the one before


def test_a_call_with_the_same_arguments_is_one_graph_launch(graph):
    g, log, _ = graph
    _call(g, 11)
    log.clear()
    _call(g, 11)
    assert log == [("launch", 7)]


def test_changed_arguments_or_grid_rewrite_only_that_node(graph):
    g, log, _ = graph
    _call(g, 11)
    log.clear()
    _call(g, 12)
    assert log == [("update", 2, (2, 1, 1), [bytes(ctypes.c_uint64(12))], False), ("launch", 7)]
    log.clear()
    _call(g, 12, grid=3)
    assert [e[0] for e in log] == ["update", "launch"] and log[0][2] == (3, 1, 1)
    log.clear()
    _call(g, 12, grid=3)
    assert log == [("launch", 7)]


def test_a_capture_gets_the_built_from_graph_brought_up_to_date_first(graph):
    g, log, capturing = graph
    _call(g, 11)
    _call(g, 12)
    log.clear()
    capturing.add(9)
    _call(g, 12, stream=9)
    assert log == [("template", 2), ("capture", 9)]
    log.clear()
    _call(g, 12, stream=9)
    assert log == [("capture", 9)]  # nothing stale any more


def test_a_first_call_inside_a_capture_adds_the_recorded_graph_and_instantiates_at_the_first_launch(graph):
    """A caller's capture of the very first call gets the recorded graph as a child; nothing is
    instantiated inside the capture. Changes before the first launch go to the recorded graph."""
    g, log, capturing = graph
    capturing.add(9)
    _call(g, 11, stream=9)
    assert [e[0] for e in log] == ["memset", "add", "add", "capture"] and not g.recording
    log.clear()
    _call(g, 12)  # eager, other arguments: the recorded graph is rewritten, then instantiated
    assert log == [("update", 2, (2, 1, 1), [bytes(ctypes.c_uint64(12))], True), ("instantiate",), ("launch", 7)]
    log.clear()
    _call(g, 13)
    assert log == [("update", 2, (2, 1, 1), [bytes(ctypes.c_uint64(13))], False), ("launch", 7)]


def test_a_graph_stays_recording_until_its_first_call_is_enqueued(graph):
    g, log, _ = graph
    g.begin()
    g.kernel(A, (2,), (128,), [ctypes.c_uint64(1)])
    assert g.recording
    g.end(7)
    assert not g.recording


def test_a_different_sequence_is_refused(graph):
    g, _, _ = graph
    _call(g, 11)
    g.begin()
    g.memset_u32(0x1000, 0, 16)
    with pytest.raises(gl.SequenceChanged):
        g.kernel(B, (1,), (32,), [ctypes.c_uint32(5)])
    g.begin()
    g.memset_u32(0x1000, 0, 16)
    g.kernel(A, (2,), (128,), [ctypes.c_uint64(11)])
    with pytest.raises(gl.SequenceChanged):
        g.end(7)  # one launch short
    g.begin()
    with pytest.raises(gl.SequenceChanged):
        g.memset_u32(0x2000, 0, 16)


def test_stream_launches_go_straight_to_the_stream(monkeypatch):
    from megamoe_rt.runtime import launches as rl

    seen = []

    class K:
        def launch(self, grid, block, args, *, stream, cluster=None):
            seen.append(("kernel", grid, block, stream))

    monkeypatch.setattr(rl.streams, "memset_d32_async", lambda p, v, n, s: seen.append(("memset", p, v, n, s)))
    q = rl.StreamLaunches(5)
    q.memset_u32(0x10, 0, 4)
    q.kernel(K(), (3,), (64,), [])
    assert seen == [("memset", 0x10, 0, 4, 5), ("kernel", (3,), (64,), 5)]


def test_a_clustered_launch_is_refused_by_a_recorded_graph(graph):
    g, _, _ = graph
    g.begin()
    with pytest.raises(NotImplementedError, match="clustered"):
        g.kernel(A, (2,), (128,), [ctypes.c_uint64(1)], cluster=(2, 1, 1))
    g.kernel(A, (2,), (128,), [ctypes.c_uint64(1)], cluster=(1, 1, 1))  # a trivial cluster is a plain launch


def test_a_graph_whose_recording_failed_is_dropped(monkeypatch):
    """UnfusedMode.run drops a half-recorded graph, so the next call records afresh."""
    from megamoe_rt.modes import unfused

    closed = []

    class FakeGraph:
        recording = True

        def begin(self):
            pass

        def end(self, stream):
            raise AssertionError("not reached")

        def close(self):
            closed.append(self)

    mode = object.__new__(unfused.UnfusedMode)
    mode.expert_parallel = True
    mode._graphs = {}
    fake = FakeGraph()
    monkeypatch.setattr(unfused, "stage_inputs", lambda *a: None)
    monkeypatch.setattr(mode, "bound_buffer", lambda: None, raising=False)
    monkeypatch.setattr(
        mode, "_call_graph", lambda call: (("int32", 1, True), mode._graphs.setdefault(("int32", 1, True), fake))
    )
    mode._staged_inputs = (0, 0)

    def boom(call, q, at):
        raise RuntimeError("a driver error mid-recording")

    monkeypatch.setattr(mode, "_run_across_ranks", boom)
    call = unfused.Call(0, 0, 0, 0, 0, 8, "int32", 8)
    with pytest.raises(RuntimeError, match="mid-recording"):
        mode.run(call, 7)
    assert mode._graphs == {} and closed == [fake]


def test_nodes_run_on_the_layers_gpu_whatever_the_current_device(monkeypatch):
    """A graph for GPU 1 recorded from a thread whose current device is 0: every node gets
    GPU 1's context (a node runs on its context's GPU), and nothing is made current."""
    log: list = []
    builder = _Builder(log)
    monkeypatch.setattr(gl, "GraphBuilder", lambda: builder)
    monkeypatch.setattr(gl.driver, "context_for", lambda ordinal: f"ctx{ordinal}")
    g = gl.GraphLaunches(device=1)
    g.begin()
    g.memset_u32(0x100, 0, 4)
    g.kernel(A, (2,), (128,), [ctypes.c_uint32(1)])
    assert builder.contexts == ["ctx1", "ctx1"]
    unbound = gl.GraphLaunches()  # no device: the builder takes the current context
    unbound.begin()
    unbound.kernel(A, (2,), (128,), [ctypes.c_uint32(1)])
    assert builder.contexts[-1] is None
