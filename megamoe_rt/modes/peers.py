"""Cross-rank helpers every mode that runs across ranks shares."""

from __future__ import annotations

from megamoe_rt.runtime import streams
from megamoe_rt.runtime.buffer import LayerBuffer, SymmetricLayerBuffer


def write_peer_table(buffer: SymmetricLayerBuffer) -> None:
    """Every rank's buffer base, as this rank maps it, into the ``peer_bases`` region."""
    import cupy

    with cupy.cuda.Device(buffer.device):
        buffer.view("peer_bases")[:] = cupy.asarray(buffer.peer_base_ptrs, dtype=cupy.uint64)
        cupy.cuda.Device(buffer.device).synchronize()


def stage_inputs(buffer: LayerBuffer, x: int, x_sf: int, num_tokens: int, stream: int) -> None:
    """x rows and their scales (device addresses ``x``, ``x_sf``) into the symmetric buffer,
    where the ranks owning their experts pull them from."""
    h = buffer.layout.hidden
    streams.memcpy_2d_async(buffer.ptr("x"), h, x, h, h, num_tokens, stream)
    streams.memcpy_2d_async(buffer.ptr("x_sf"), h // 32, x_sf, h // 32, h // 32, num_tokens, stream)
