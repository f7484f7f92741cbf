"""``megamoe-rt plan`` sizes the buffer the layer allocates, for every mode and option.

The layer's allocation is caught where it happens (``MegaMoE`` constructed up to its buffer with
a stand-in GPU), so the comparison is against what the constructor would allocate, not against
the sizing function both call.
"""

from __future__ import annotations

import json

import pytest

from megamoe_rt.cli.main import main
from megamoe_rt.modes.registry import mode_names
from megamoe_rt.presets import get_preset
from megamoe_rt.runtime import devices, driver
from megamoe_rt.schedule.streaming import StreamConfig


class _Allocated(Exception):
    def __init__(self, layout):
        super().__init__("allocated")
        self.layout = layout


FREE_GIB = 20.0


@pytest.fixture
def allocation(monkeypatch):
    """MegaMoE(...) -> the layout its buffer would be allocated with (no GPU touched)."""
    from megamoe_rt import layer as layer_module
    from megamoe_rt import layer_setup
    from megamoe_rt.modes import split as split_module

    info = devices.DeviceInfo(0, "stand-in H200", (9, 0), 132, 141 * 2**30, 60 * 2**20, 227 * 1024, 1_980_000, "0")
    monkeypatch.setattr(devices, "require_hopper", lambda device=None: info)
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: None)
    monkeypatch.setattr(devices, "device_info", lambda device=0: info)
    monkeypatch.setattr(driver, "free_memory_bytes", lambda device=None: int(FREE_GIB * 2**30))
    monkeypatch.setattr(split_module, "partition_granularity", lambda device: 8)  # Hopper's green-context step

    def allocate(layout, device=None):
        raise _Allocated(layout)

    monkeypatch.setattr(layer_setup, "DeviceBuffer", allocate)

    def build(preset: str, tokens: int, **kw):
        p = get_preset(preset)
        experts = p.num_experts // 8
        with pytest.raises(_Allocated) as caught:
            layer_module.MegaMoE(p.hidden, p.intermediate, experts, p.num_topk, tokens, **kw)
        return caught.value.layout

    return build


def _plan(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


CASES = [
    ({}, ()),
    ({"ring_blocks": "RING"}, ("--ring-blocks", "RING")),  # a few blocks over the mode's smallest ring
    ({"chunk_ratio": 0.25}, ("--chunk-ratio", "0.25")),
    ({"chunk_ratio": 1.0}, ("--chunk-ratio", "1")),
    ({"chunk_ratio": "auto"}, ("--chunk-ratio", "auto", "--free-gib", str(FREE_GIB))),
    ({"act_sf_gran": 64}, ("--act-sf-gran", "64")),
    ({"token_window": 700}, ("--token-window", "700")),
    ({"token_window": 2048, "chunk_ratio": 0.5}, ("--token-window", "2048", "--chunk-ratio", "0.5")),
    ({"token_window": 10**6}, ("--token-window", "1000000")),  # a window above the capacity: one window
]


@pytest.mark.parametrize("mode", mode_names())
@pytest.mark.parametrize("preset,tokens", [("flash", 8192), ("pro", 65536), ("v3", 1000)])
@pytest.mark.parametrize("kw,options", CASES, ids=[" ".join(o) or "default" for _, o in CASES])
def test_plan_is_what_the_layer_allocates(capsys, allocation, mode, preset, tokens, kw, options):
    p = get_preset(preset)
    if kw.get("ring_blocks") == "RING":
        from megamoe_rt.modes.base import LayerSpec
        from megamoe_rt.modes.registry import MODES

        spec = LayerSpec(p.hidden, p.intermediate, p.num_experts // 8, p.num_topk, tokens)
        ring = MODES[mode].minimum_ring_blocks(spec) + 7
        kw, options = {"ring_blocks": ring}, ("--ring-blocks", str(ring))
    layout = allocation(preset, tokens, mode=mode, **kw)
    out = _plan(
        capsys,
        *("--preset", preset, "--tokens", str(tokens), "--ranks", "1", "--experts", str(p.num_experts // 8)),
        *("--mode", mode, *options),
    )
    assert out["mode"] == mode
    assert out["total_bytes"] == layout.total_bytes
    assert (out["pool"], out["pool_blocks"], out["block_m"]) == (layout.pool, layout.pool_blocks, layout.block_m)
    assert [(r["name"], r["bytes"]) for r in out["regions"]] == [(n, b) for n, b, _ in layout.report()]
    assert out["full_pool_total_bytes"] >= out["total_bytes"]


def test_a_streamed_layer_is_planned_with_its_input_ring(capsys, allocation):
    layout = allocation("flash", 4096, streaming=StreamConfig(4, 512))
    out = _plan(capsys, "--preset", "flash", "--tokens", "4096", "--ranks", "1", "--experts", "32", "--stream", "4x512")
    assert out["mode"] == "unfused"  # the mode a streamed layer picks by default
    assert out["total_bytes"] == layout.total_bytes
    names = {r["name"] for r in out["regions"] if r["bytes"]}
    without = _plan(
        capsys, "--preset", "flash", "--tokens", "4096", "--ranks", "1", "--experts", "32", "--mode", "unfused"
    )
    assert out["total_bytes"] > without["total_bytes"]
    assert names - {r["name"] for r in without["regions"] if r["bytes"]}, "the ring's regions are in the report"


def test_a_mode_that_does_not_stream_is_refused_in_the_options_typed(capsys):
    assert main(["plan", "--stream", "4x512", "--mode", "split", "--tokens", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megamoe-rt plan: --stream: runs in --mode 'fused'"), err


def test_the_layer_refuses_streaming_in_a_mode_that_does_not_take_it_before_looking_for_a_gpu():
    from megamoe_rt.layer import MegaMoE

    with pytest.raises(ValueError, match="streaming: runs in mode='fused' .*not mode='split'"):
        MegaMoE(512, 256, 16, 6, 1024, mode="split", streaming=StreamConfig(2, 256))


def test_a_streamed_layer_across_ranks_falls_back_to_the_unfused_mode(capsys):
    out = _plan(capsys, "--preset", "flash", "--tokens", "4096", "--ranks", "2", "--experts", "64", "--stream", "4x512")
    assert out["mode"] == "unfused"
    assert main(["plan", "--stream", "4x512", "--mode", "fused", "--ranks", "2", "--tokens", "4096"]) == 2
    assert "streaming across ranks: runs in --mode 'unfused'" in capsys.readouterr().err


def test_the_fused_mode_streams_on_one_rank_over_the_full_pool(capsys):
    one = ("--preset", "flash", "--tokens", "4096", "--ranks", "1", "--experts", "32", "--mode", "fused")
    out = _plan(capsys, *one, "--stream", "4x512")
    names = {r["name"] for r in out["regions"] if r["bytes"]}
    assert {"stream_call_topk_idx", "stream_x"} <= names
    full = _plan(capsys, *one)
    # The batch layer's pool is a ring around its schedule; the streamed one holds every block.
    assert (out["pool"], full["pool"]) == ("full", "ring")
    assert out["pool_blocks"] >= full["pool_blocks"]
    ring = _plan(capsys, *one, "--stream", "4x512", "--mode", "unfused")  # the same ring in the other mode
    assert {r["name"]: r["bytes"] for r in out["regions"]}["stream_x"] == {
        r["name"]: r["bytes"] for r in ring["regions"]
    }["stream_x"]
    assert main(["plan", *one, "--stream", "4x512", "--ring-blocks", "8"]) == 2
    assert "--ring-blocks 8: a streamed layer in --mode 'fused' holds the full pool" in capsys.readouterr().err


def test_the_nvshmem_transport_adds_its_staging_regions(capsys):
    base = ("--preset", "flash", "--tokens", "2048", "--ranks", "2", "--experts", "64", "--mode", "unfused")
    nvlink = _plan(capsys, *base)
    nvshmem = _plan(capsys, *base, "--transport", "nvshmem")
    assert nvshmem["total_bytes"] > nvlink["total_bytes"]
    assert main(["plan", *base[:-2], "--mode", "fused", "--transport", "nvshmem"]) == 2
    assert "--transport 'nvshmem'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--chunk-ratio", "auto"), "--chunk-ratio auto sizes the ring by the memory free: give --free-gib"),
        (("--chunk-ratio", "0"), "argument --chunk-ratio: expected a number in (0, 1] or 'auto', got '0'"),
        (("--stream", "4by512"), "argument --stream: expected SLOTSxTOKENS (e.g. 4x512), got '4by512'"),
        (("--stream", "1x100000"), "--stream 1x100000: a slot holds more than --tokens 8192"),
        (("--ranks", "1", "--transport", "nvshmem"), "--transport nvshmem needs --ranks of 2 or more"),
        (("--ring-blocks", "40", "--chunk-ratio", "0.5"), "--ring-blocks 40, --chunk-ratio 0.5: pass one of them"),
        (("--mode", "fused", "--ring-blocks", "1"), "--ring-blocks 1: expected at least the live window"),
    ],
)
def test_plan_refuses_layer_options_in_their_own_names(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "ring_blocks" not in err and "chunk_ratio" not in err, err


def test_a_token_window_sizes_the_buffer_for_the_window_and_plans_the_whole_call_against_it(capsys, allocation):
    layout = allocation("flash", 131072, mode="unfused", token_window=16384)
    argv = ("--preset", "flash", "--tokens", "131072", "--ranks", "1", "--experts", "32", "--mode", "unfused")
    out = _plan(capsys, *argv, "--token-window", "16384")
    assert out["total_bytes"] == layout.total_bytes and out["num_max_tokens_per_rank"] == 16384
    window_of_16k = _plan(capsys, *argv[:3], "16384", *argv[4:])
    assert out["total_bytes"] == window_of_16k["total_bytes"]  # the buffer of a 16K-token layer
    assert out["total_bytes"] < 4 * 2**30 < out["full_pool_total_bytes"]
    assert main(["plan", *argv, "--token-window", "16384"]) == 0
    assert "a call of 131072 tokens runs as 8 windows" in capsys.readouterr().out


def test_a_token_window_is_refused_with_streaming_in_the_options_typed(capsys):
    from megamoe_rt.layer import MegaMoE

    with pytest.raises(ValueError, match="token_window=64: a streamed layer"):
        MegaMoE(512, 256, 16, 6, 1024, token_window=64, streaming=StreamConfig(2, 256))
    assert main(["plan", "--stream", "4x512", "--token-window", "1024"]) == 2
    assert "--token-window and --stream" in capsys.readouterr().err
