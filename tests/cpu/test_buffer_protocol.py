"""The buffer protocols: what the layer and its modes may rely on in a buffer (CPU).

The buffers are made without a GPU (no allocation); the protocols only look at attributes."""

from __future__ import annotations

from megamoe_rt.ep.symm import SymmetricBuffer
from megamoe_rt.runtime.buffer import DeviceBuffer, LayerBuffer, SymmetricLayerBuffer
from megamoe_rt.schedule.layout import symm_buffer_layout


def _bare(cls, **attrs):
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def test_device_and_symmetric_buffers_satisfy_their_protocols():
    layout = symm_buffer_layout(512, 256, 16, 2, 128, 2)
    plain = _bare(DeviceBuffer, layout=layout, device=0, base_ptr=0x10000)
    symm = _bare(SymmetricBuffer, layout=layout, device=1, base_ptr=0x20000, rank=1, peer_base_ptrs=[0x30000, 0x20000])
    assert isinstance(plain, LayerBuffer) and not isinstance(plain, SymmetricLayerBuffer)
    assert isinstance(symm, LayerBuffer) and isinstance(symm, SymmetricLayerBuffer)
    # What the protocol promises works on the bare objects: region addresses and peer tables.
    first = layout.regions[0].name
    assert plain.ptr(first) == 0x10000 + layout.region(first).offset
    assert symm.peer_ptr(0, first) == 0x30000 + layout.region(first).offset
    assert list(symm.peer_table()) == [0x30000, 0x20000]


def test_something_without_views_is_not_a_layer_buffer():
    class AddressesOnly:
        layout, device, base_ptr = None, 0, 0

        def ptr(self, name):
            return 0

    assert not isinstance(AddressesOnly(), LayerBuffer)
