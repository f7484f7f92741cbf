"""Streaming a layer call's inputs: producers publish token chunks into the layer's input ring
while :meth:`MegaMoE.consume <megamoe_rt.layer.MegaMoE.consume>` runs on the chunks already
published.

Two ways to produce:

- your own kernels (a router, a layout kernel) include ``"stream/producer.cuh"`` and take the
  ring's descriptor, ``layer.input_ring.descriptor`` (a ctypes ``StreamRing``, passed by value),
  compiled with :func:`producer_options`; per chunk they wait for the slot, write it and
  publish both halves (the header's comment has the protocol);
- :class:`ChunkWriter` copies chunks of CuPy arrays into the ring with small kernels.

Progress: the layer waits for each chunk on the GPU. Producers must be able to run meanwhile:
on another stream than the layer's call (the overlap this is for), or enqueued before the call
on the same stream. Never after it on the same stream: the layer's wait would trap at its
deadline (naming the slot and generation). Correctness never depends on the overlap.
"""

from __future__ import annotations

from typing import Any

from megamoe_rt.kernels.stream import InputRing, producer_options
from megamoe_rt.runtime import args, streams
from megamoe_rt.runtime.arrays import as_device_array, check_array
from megamoe_rt.schedule.streaming import StreamConfig

__all__ = ["ChunkWriter", "InputRing", "StreamConfig", "producer_options"]


class ChunkWriter:
    """Writes a call's inputs into a layer's input ring, chunk by chunk, with small kernels
    (no host synchronisation): ``begin_call`` once per call, then ``write`` per chunk or
    ``write_all``; on the writer's stream, which must be able to run while the layer waits."""

    def __init__(self, layer: Any):
        ring = getattr(layer, "input_ring", None)
        if ring is None:
            raise ValueError("ChunkWriter: the layer was built without streaming=StreamConfig(...)")
        self.layer, self.ring = layer, ring
        self.config: StreamConfig = layer.streaming
        ring.load_kernels()

    def begin_call(self, *, stream: Any = None) -> None:
        """A new call starts: the chunks written next carry its generation."""
        self._check_open()
        self.ring.begin_call(streams.stream_handle(stream))

    def write(self, chunk: int, x: Any, x_sf: Any, topk_idx: Any, topk_weights: Any, *, stream: Any = None) -> None:
        """Chunk ``chunk`` of the call whose inputs are the whole-call arrays ``x`` e4m3
        ``[T, H]``, ``x_sf`` ``[T, H/128]``, ``topk_idx`` int32 or int64 ``[T, K]``, ``topk_weights``
        ``[T, K]``: waits (on the device) for its slot, copies the chunk's tokens, publishes."""
        self._check_open()
        sh = streams.stream_handle(stream)
        inputs, t = self._inputs(x, x_sf, topk_idx, topk_weights, sh)
        chunks = self.config.num_chunks(t)
        chunk = args.integer("chunk", chunk)
        if not 0 <= chunk < chunks:
            # An empty call has no chunk: the layer consumes none, so a chunk written for it
            # would hold its slot until the next call's producer trapped waiting for it.
            have = f"chunks 0..{chunks - 1}" if chunks else "no chunks"
            raise ValueError(f"chunk={chunk}: a call of {t} tokens has {have}")
        self.ring.check_producer(sh)
        self.ring.write_chunk(chunk, inputs, t, self.layer.device_info.sm_count, sh)

    def write_all(self, x: Any, x_sf: Any, topk_idx: Any, topk_weights: Any, *, stream: Any = None) -> None:
        """``begin_call`` and every chunk of the call, in order."""
        self._check_open()
        sh = streams.stream_handle(stream)
        inputs, t = self._inputs(x, x_sf, topk_idx, topk_weights, sh)  # checked before the call begins
        self.begin_call(stream=stream)
        for chunk in range(self.config.num_chunks(t)):
            self.ring.write_chunk(chunk, inputs, t, self.layer.device_info.sm_count, sh)

    def _check_open(self) -> None:
        if self.layer.closed:
            raise RuntimeError("ChunkWriter: the layer was closed (its input ring is freed)")

    def _inputs(self, x: Any, x_sf: Any, topk_idx: Any, topk_weights: Any, sh: int) -> tuple[dict[str, int], int]:
        h, k, dev = self.layer.hidden, self.layer.num_topk, self.layer.device
        xa = as_device_array(x, "x", stream=sh)
        check_array(xa, "x", dtypes=("e4m3",), ndim=2, device=dev)
        t = xa.shape[0]
        if xa.shape[1] != h:
            raise ValueError(f"x: expected shape [T, {h}], got {list(xa.shape)}")
        capacity = self.layer.num_max_tokens_per_rank
        if t > capacity:
            # The layer consumes at most the capacity's chunks; the rest would wait for slots
            # that are never released.
            raise ValueError(f"x: {t} tokens exceed the layer's capacity (num_max_tokens_per_rank={capacity})")
        sfa = as_device_array(x_sf, "x_sf", stream=sh)
        check_array(sfa, "x_sf", dtypes=("float32",), shape=(t, h // 128), device=dev, align=4)
        ia = as_device_array(topk_idx, "topk_idx", stream=sh)
        check_array(ia, "topk_idx", dtypes=("int32", "int64"), shape=(t, k), device=dev, align=ia.itemsize)
        wa = as_device_array(topk_weights, "topk_weights", stream=sh)
        check_array(wa, "topk_weights", dtypes=("float32",), shape=(t, k), device=dev, align=4)
        inputs = {
            "x": xa.ptr,
            "x_sf": sfa.ptr,
            "topk_idx": ia.ptr,
            "topk_weights": wa.ptr,
            "topk_idx_bytes": ia.itemsize,
        }
        return inputs, t
