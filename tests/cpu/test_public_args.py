"""Scalar and array arguments of the public API refused before any GPU work: a wrong type is a
TypeError, a wrong value a ValueError, each naming the argument."""

from __future__ import annotations

import types

import numpy as np
import pytest

from megamoe_rt import reference as ref
from megamoe_rt.runtime import args
from megamoe_rt.runtime.arrays import as_device_array, check_array, check_disjoint
from megamoe_rt.runtime.streams import stream_handle
from megamoe_rt.schedule.streaming import StreamConfig
from tests.cpu.test_arrays import FakeCai


def _layer(**kw):
    from megamoe_rt import MegaMoE

    return MegaMoE(512, 256, 8, 2, 64, **kw)


def test_integer_arguments_take_numpy_ints_and_refuse_bools_and_floats():
    assert args.integer("n", np.int64(7), minimum=1) == 7
    for bad in (True, np.bool_(False), 7.0, "7", None):
        with pytest.raises(TypeError, match="n: expected an integer"):
            args.integer("n", bad)
    with pytest.raises(ValueError, match="n=0: expected an integer >= 1"):
        args.integer("n", 0, minimum=1)
    assert args.integer_choice("g", np.int32(64), (64, 128)) == 64
    with pytest.raises(ValueError, match="g: expected one of 64, 128, got 32"):
        args.integer_choice("g", 32, (64, 128))


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"act_sf_gran": 64.0}, TypeError, "act_sf_gran: expected an integer"),
        ({"act_sf_gran": True}, TypeError, "act_sf_gran: expected an integer"),
        ({"act_sf_gran": 96}, ValueError, "act_sf_gran: expected one of 64, 128"),
        ({"swiglu_limit": float("inf")}, ValueError, "swiglu_limit: expected a positive finite number"),
        ({"swiglu_limit": float("nan")}, ValueError, "swiglu_limit: expected a positive finite number"),
        ({"swiglu_limit": "3"}, TypeError, "swiglu_limit: expected a real number"),
        ({"swiglu_limit": True}, TypeError, "swiglu_limit: expected a real number"),
        ({"swiglu_limit": 1e-50}, ValueError, "float32 holds as positive"),
        ({"device": True}, TypeError, "device: expected an integer"),
        ({"device": "0"}, TypeError, "device: expected an integer"),
        ({"device": -1}, ValueError, "device=-1"),
        ({"group": object()}, TypeError, "group: expected a RankGroup"),
        ({"mode": "unfused", "ring_blocks": True}, TypeError, "ring_blocks: expected an integer"),
        ({"mode": "unfused", "ring_blocks": 4.0}, TypeError, "ring_blocks: expected an integer"),
    ],
)
def test_layer_options_are_checked_before_looking_for_a_gpu(kw, error, match):
    with pytest.raises(error, match=match):
        _layer(**kw)


def test_streams_are_not_taken_from_floats_or_strings():
    for bad in (1.5, 2.9, "5", b"5", np.float32(1)):
        with pytest.raises(TypeError, match="stream: expected a stream or an int handle"):
            stream_handle(bad)
    assert stream_handle(np.uint64(0)) == 0


def test_stream_config_takes_numpy_ints():
    cfg = StreamConfig(np.int64(2), np.int32(128))
    assert (cfg.num_slots, cfg.tokens_per_slot) == (2, 128) and type(cfg.num_slots) is int
    with pytest.raises(TypeError, match="StreamConfig.num_slots"):
        StreamConfig(True, 128)


def test_an_empty_array_is_contiguous_whatever_its_strides():
    a = as_device_array(FakeCai((4, 0, 512), "|u1"), "a")
    assert a.is_c_contiguous()
    check_array(a, "a", dtypes=("e4m3",))


def test_an_output_over_an_input_is_refused():
    x = as_device_array(FakeCai((8, 256), "|u1", ptr=0x100000), "x")
    w = as_device_array(FakeCai((8, 4), "<f4", ptr=0x200000), "topk_weights")
    inside = as_device_array(FakeCai((4, 256), "<u2", ptr=0x100400), "out")
    with pytest.raises(ValueError, match="out: overlaps x"):
        check_disjoint(inside, "out", {"x": x, "topk_weights": w})
    beside = as_device_array(FakeCai((4, 256), "<u2", ptr=0x100000 + 8 * 256), "out")
    check_disjoint(beside, "out", {"x": x, "topk_weights": w, "x_sf": None})  # touching is fine
    empty = as_device_array(FakeCai((0, 4), "<f4", ptr=0x100010), "x_sf")
    check_disjoint(x, "out", {"x_sf": empty})  # an empty input occupies no byte
    strided = as_device_array(FakeCai((2, 4), "<f4", ptr=0x200000 - 64, strides=(96, 4)), "out")
    with pytest.raises(ValueError, match="out: overlaps topk_weights"):
        check_disjoint(strided, "out", {"topk_weights": w})


def test_calc_diff_refuses_raw_bits_and_survives_large_values():
    a = np.linspace(-3, 3, 64, dtype=np.float32)
    bits = (a.view(np.uint32) >> 16).astype(np.uint16)
    with pytest.raises(TypeError, match="a: expected floating-point values"):
        ref.calc_diff(bits, a)
    big = np.array([1e200, -3e200, 2e200])
    assert ref.calc_diff(big, big) == pytest.approx(0.0, abs=1e-12)
    assert ref.calc_diff(big, -big) == pytest.approx(2.0)
    assert ref.calc_diff(a.astype(ref.BF16), a) < 1e-4


def test_the_reference_drops_a_repeated_expert_like_the_layer():
    rng = np.random.default_rng(3)
    inp = ref.random_moe_inputs(rng, 6, 256, 128, 8, 4)
    idx = inp["topk_idx"].copy()
    idx[2] = [5, 1, 5, 5]
    idx[4] = [3, -1, 3, 0]
    clean = idx.copy()
    clean[2] = [5, 1, -1, -1]
    clean[4] = [3, -1, -1, 0]
    np.testing.assert_array_equal(ref.drop_repeated_ids(idx), clean)
    w = (inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    got = ref.moe_forward(inp["x"], inp["x_sf"], idx, inp["topk_weights"], *w)
    want = ref.moe_forward(inp["x"], inp["x_sf"], clean, inp["topk_weights"], *w)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


class _FakeRing:
    def __init__(self):
        self.writes: list[int] = []
        self.calls = 0

    def load_kernels(self):
        pass

    def check_producer(self, stream, *, new_call=False):
        pass

    def begin_call(self, stream):
        self.calls += 1

    def write_chunk(self, chunk, inputs, num_tokens, sm_count, stream):
        self.writes.append(chunk)


def _writer(closed=False):
    from megamoe_rt.streaming import ChunkWriter

    layer = types.SimpleNamespace(
        input_ring=_FakeRing(),
        streaming=StreamConfig(2, 32),
        closed=closed,
        hidden=256,
        num_topk=4,
        device=None,
        num_max_tokens_per_rank=64,
        device_info=types.SimpleNamespace(sm_count=132),
    )
    return ChunkWriter(layer), layer.input_ring


def _chunk_args(t, idx_type="<i4"):
    return (
        FakeCai((t, 256), "|u1", ptr=0x100000),
        FakeCai((t, 2), "<f4", ptr=0x200000),
        FakeCai((t, 4), idx_type, ptr=0x300000),
        FakeCai((t, 4), "<f4", ptr=0x400000),
    )


def test_the_chunk_writer_refuses_what_the_layer_would_never_consume():
    writer, ring = _writer()
    with pytest.raises(ValueError, match="chunk=0: a call of 0 tokens has no chunks"):
        writer.write(0, *_chunk_args(0), stream=0)
    with pytest.raises(ValueError, match="x: 65 tokens exceed the layer's capacity"):
        writer.write_all(*_chunk_args(65), stream=0)
    with pytest.raises(TypeError, match="chunk: expected an integer"):
        writer.write(True, *_chunk_args(40), stream=0)
    assert ring.writes == [] and ring.calls == 0  # nothing launched, no call begun
    writer.write(np.int64(1), *_chunk_args(40, "<i8"), stream=0)  # int64 ids, NumPy chunk index
    writer.write_all(*_chunk_args(0), stream=0)  # an empty call: begun, no chunk
    assert ring.writes == [1] and ring.calls == 1


def test_the_chunk_writer_refuses_a_closed_layer():
    writer, ring = _writer(closed=True)
    with pytest.raises(RuntimeError, match="the layer was closed"):
        writer.write_all(*_chunk_args(8))
    with pytest.raises(RuntimeError, match="the layer was closed"):
        writer.begin_call()
    with pytest.raises(RuntimeError, match="the layer was closed"):
        writer.write(0, *_chunk_args(8))
    assert ring.calls == 0


def test_weights_given_as_lists_are_a_type_error():
    from megamoe_rt.kernels.grouped_gemm import prepare_swiglu_weights

    with pytest.raises(TypeError, match="w1: expected a NumPy or CuPy array, got list"):
        prepare_swiglu_weights([[[0]]], np.zeros((1, 2, 1), np.float32))


def test_weights_of_no_group_are_refused_by_name():
    from megamoe_rt.kernels.operands import weight_operand

    with pytest.raises(ValueError, match=r"b: expected \[G, N, K\] with G >= 1 and N >= 1, got shape \[0, 256, 128\]"):
        weight_operand(FakeCai((0, 256, 128), "|u1"), FakeCai((0, 2, 1), "<f4"), stream=0)
