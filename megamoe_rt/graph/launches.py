"""Where a mode's launches go: straight onto a stream, or into a CUDA graph replayed per call.

A call of the unfused mode across ranks is a dozen small launches (memsets, six routing steps,
the pull and two GEMMs per cycle, finish, combine). Launched one by one, their host cost
(about 20 µs each through Python and the driver) exceeds the device time of a small call,
so the GPU waits for the host. :class:`GraphLaunches` records the sequence once into a graph
and replays it: each later call walks the same launches and rewrites only the nodes whose
grid or arguments changed, then launches the graph. With the same arrays from call to call a
call is one graph launch; with new arrays, one node update per launch that reads them (about
what launching it costs). The split mode's graph follows the same rule.

The sequence must be the same from call to call (same kernels in the same order): callers key
one :class:`GraphLaunches` per sequence shape (for the unfused mode: id dtype, cycle count,
whether the rank has tokens), and a call whose sequence differs raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megamoe_rt.graph.builder import GraphBuilder, KernelNode
from megamoe_rt.runtime import driver, streams
from megamoe_rt.runtime.launches import Launches as Launches
from megamoe_rt.runtime.launches import StreamLaunches as StreamLaunches


class SequenceChanged(RuntimeError):
    """A replayed call's launches are not the recorded ones (a caller keyed the graph wrong)."""


@dataclass
class _Recorded:
    node: Any  # KernelNode, or a memset node handle
    kernel: Any  # None for a memset
    block: tuple[int, ...]
    grid: tuple[int, ...]
    raw: bytes  # the arguments' bytes (a memset's pointer, value and count)
    template_stale: bool = False  # the executable graph was updated, the graph it came from not


def _dims(v: Sequence[int]) -> tuple[int, ...]:
    t = tuple(int(x) for x in v)
    return t + (1,) * (3 - len(t))


class GraphLaunches:
    """A call's launches recorded into a graph on the first call, replayed on later ones.

    Per call: :meth:`begin`, the launches (the same ones each call), then :meth:`end` with the
    call's stream (a launch of the graph, or a child node when the stream is capturing)."""

    def __init__(self, device: int | None = None) -> None:
        # The nodes' context: the GPU's (``device``), whatever the calling thread's current
        # device is; None: the current context (a node runs on its context's GPU).
        self.device = device
        self.builder = GraphBuilder()
        self._nodes: list[_Recorded] = []
        self._recording = True
        self._instantiated = False
        self._pos = 0

    def begin(self) -> None:
        self._pos = 0

    def _context(self) -> Any:
        return None if self.device is None else driver.context_for(self.device)

    def _previous(self) -> list[Any]:
        if not self._nodes:
            return []
        n = self._nodes[-1].node
        return [n.node if isinstance(n, KernelNode) else n]

    def _next(self, kernel: Any, block: tuple[int, ...]) -> _Recorded:
        if self._pos >= len(self._nodes):
            raise SequenceChanged(f"launch {self._pos}: the recorded call had {len(self._nodes)} launches")
        rec = self._nodes[self._pos]
        if rec.kernel is not kernel or rec.block != block:
            raise SequenceChanged(f"launch {self._pos} is not the recorded launch")
        self._pos += 1
        return rec

    def kernel(
        self, kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], *, cluster: Any = None
    ) -> None:
        if cluster is not None and _dims(cluster) != (1, 1, 1):
            raise NotImplementedError(
                "a clustered launch in a recorded graph (no cluster-dimension node attribute yet)"
            )
        g, b = _dims(grid), _dims(block)
        raw = b"".join(bytes(a) for a in args)
        if self._recording:
            node = self.builder.add_kernel(kernel, g, b, args, deps=self._previous(), ctx=self._context())
            self._nodes.append(_Recorded(node, kernel, b, g, raw))
            return
        rec = self._next(kernel, b)
        if rec.grid != g or rec.raw != raw:
            # Before the first launch there is no executable graph yet: the recorded one is rewritten.
            self.builder.update_kernel(rec.node, args, grid=g, template=not self._instantiated)
            rec.grid, rec.raw, rec.template_stale = g, raw, self._instantiated

    def memset_u32(self, ptr: int, value: int, count: int) -> None:
        raw = repr((ptr, value, count)).encode()
        if self._recording:
            node = self.builder.add_memset_u32(ptr, value, count, deps=self._previous(), ctx=self._context())
            self._nodes.append(_Recorded(node, None, (), (), raw))
            return
        rec = self._next(None, ())
        if rec.raw != raw:
            raise SequenceChanged(f"launch {self._pos - 1}: a memset of another region than the recorded one")

    @property
    def recording(self) -> bool:
        """True until the first call's launches are recorded and enqueued."""
        return self._recording

    def end(self, stream: int) -> None:
        if not self._recording and self._pos != len(self._nodes):
            raise SequenceChanged(f"{self._pos} launches, the recorded call had {len(self._nodes)}")
        if streams.stream_is_capturing(stream):
            # The capture copies the graph the executable one came from: bring it up to date.
            for rec in self._nodes:
                if rec.template_stale:
                    self.builder.update_template(rec.node)
                    rec.template_stale = False
            self.builder.add_to_capture(stream)
        else:
            # Instantiated at the first launch, not when recorded: a first call made inside a
            # caller's capture only adds the recorded graph to it, and a capture in the global
            # mode may refuse calls that are no stream work.
            if not self._instantiated:
                self.builder.instantiate()
                self._instantiated = True
            self.builder.launch(stream)
        self._recording = False

    def close(self) -> None:
        self.builder.close()
