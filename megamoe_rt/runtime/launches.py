"""Where a call's launches go (:class:`Launches`): :class:`StreamLaunches` puts each onto a
stream; :class:`megamoe_rt.graph.launches.GraphLaunches` records them into a CUDA graph that
later calls replay. Launch helpers take a ``Launches`` so one sequence serves both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from megamoe_rt.runtime import streams


class Launches(Protocol):
    """The launches of one call, in order."""

    def kernel(
        self, kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], *, cluster: Any = None
    ) -> None: ...

    def memset_u32(self, ptr: int, value: int, count: int) -> None: ...


class StreamLaunches:
    """Each launch straight onto ``stream``."""

    def __init__(self, stream: int):
        self.stream = stream

    def kernel(
        self, kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], *, cluster: Any = None
    ) -> None:
        kernel.launch(grid, block, args, stream=self.stream, cluster=cluster)

    def memset_u32(self, ptr: int, value: int, count: int) -> None:
        streams.memset_d32_async(ptr, value, count, self.stream)
