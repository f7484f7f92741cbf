"""A bar chart as a PNG with nothing but zlib: what ``tune-split`` draws without matplotlib.

Bars left to right in the order given, heights proportional to the values (the axis starts
at zero), the highlighted bar in another colour, a line at a reference value. No text: the
command prints the same numbers as a table.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

_BG, _BAR, _BEST, _REF, _AXIS = (255, 255, 255), (70, 110, 180), (220, 120, 30), (200, 40, 40), (0, 0, 0)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bar_chart_png(
    values: Sequence[float], *, highlight: int | None = None, reference: float | None = None, bar_px: int = 36
) -> bytes:
    """PNG bytes of one bar per value; ``reference`` draws a horizontal line at that value."""
    if not values or min(values) < 0:
        raise ValueError(f"values: expected non-negative numbers, got {list(values)!r}")
    height, margin = 240, 10
    width = margin * 2 + bar_px * len(values)
    top = max([*values, reference or 0.0]) or 1.0
    scale = (height - 2 * margin) / top
    pixels = [[_BG] * width for _ in range(height)]
    base = height - margin
    for n, v in enumerate(values):
        colour = _BEST if n == highlight else _BAR
        x0 = margin + n * bar_px + 4
        for y in range(base - round(v * scale), base):
            for x in range(x0, x0 + bar_px - 8):
                pixels[y][x] = colour
    if reference is not None:
        y = base - round(reference * scale)
        for x in range(margin, width - margin):
            pixels[max(0, y)][x] = _REF
    for x in range(margin, width - margin):
        pixels[base][x] = _AXIS
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    )
