"""Calling a layer in the GPU tests: host inputs to the device, a call into a poisoned output."""

from __future__ import annotations

import numpy as np

BF16_NAN = 0x7FC1  # the poison every output starts from: a row the layer skips stays NaN


def bf16(bits):
    """bf16 bits (uint16) as float32 values."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def device_args(inp):
    """The four call arguments of ``reference.random_moe_inputs`` output, on the device."""
    import cupy as cp

    return [
        cp.asarray(inp["x"].view(np.uint8)),
        cp.asarray(inp["x_sf"]),
        cp.asarray(inp["topk_idx"]),
        cp.asarray(inp["topk_weights"]),
    ]


def run_poisoned(layer, args, **kw):
    """One call into an output filled with NaN first; the output on the host."""
    import cupy as cp

    out = cp.full((args[0].shape[0], layer.hidden), BF16_NAN, dtype=cp.uint16)
    layer(*args, out=out, **kw)
    return cp.asnumpy(out)


def replay_captured(layer, args, out, *, replays=3):
    """One call captured into a CUDA graph on a fresh stream, then replayed ``replays`` times,
    ``out`` poisoned before each replay; returns when the last replay is done."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        layer(*args, out=out, stream=stream)
        graph = stream.end_capture()
        for _ in range(replays):
            out.fill(BF16_NAN)
            graph.launch(stream=stream)
        stream.synchronize()


def replay_with_new_inputs(layer, args, out, fresh_args, want, *, replays=2):
    """``layer`` called on ``args`` into ``out``, captured into a CUDA graph (after a warm-up call
    that loads its kernels outside the capture), then replayed ``replays`` times, each time with
    ``fresh_args()`` copied into ``args`` and ``out`` poisoned; after each replay ``out`` must be
    bit for bit ``want(args)``."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        layer(*args, out=out, stream=stream)
        stream.synchronize()
        stream.begin_capture()
        layer(*args, out=out, stream=stream)
        graph = stream.end_capture()
    for _ in range(replays):
        for dst, src in zip(args, fresh_args(), strict=True):
            dst[...] = src
        out.fill(BF16_NAN)
        graph.launch(stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), want(args))
