"""Argument checks shared by the ``megamoe-rt`` commands and the modules they run as.

A bad argument is a :class:`UsageError`: one line on stderr, exit status 2, raised before
any GPU work (``exit_status``). ``Parser`` turns argparse's own errors (and the
``ArgumentTypeError`` of the types below) into one.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints usage + message over several lines
        raise UsageError(f"{self.prog}: {message}")


def report(exc: UsageError) -> int:
    """Print ``exc`` as one line on stderr; the exit status of a usage error (2)."""
    print(str(exc).splitlines()[0], file=sys.stderr)
    return 2


def exit_status(command: Callable[[], int | None]) -> int:
    """Run ``command``: its exit status, or 2 after one line on stderr for a UsageError."""
    try:
        return int(command() or 0)
    except UsageError as exc:
        return report(exc)
    except BrokenPipeError:
        return 0


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _positive_finite(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v


def positive_seconds(text: str) -> float:
    return _positive_finite(text, "a positive number of seconds")


def positive_number(text: str) -> float:
    """A positive, finite number (a rate, a bandwidth)."""
    return _positive_finite(text, "a positive finite number")


def csv(kind, valid=None):
    """A comma-separated list of ``kind``: ints positive, floats shares in (0, 1], strings
    from ``valid`` when given."""

    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        try:
            out = [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad list {text!r}") from None
        if valid is not None:
            bad = [t for t in out if t not in valid]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; expected from {', '.join(valid)}")
        if kind is int and min(out) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
        if kind is float and not all(0.0 < v <= 1.0 for v in out):
            raise argparse.ArgumentTypeError(f"expected shares in (0, 1], got {text!r}")
        return out

    return parse


def mode(text: str) -> str:
    """One execution mode. The registry is imported only when the option is given (argparse
    converts nothing for a default of None), so commands that run without one start fast."""
    from megamoe_rt.modes.registry import mode_names

    if text not in mode_names():
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(mode_names())}, got {text!r}")
    return text


def modes(text: str, *, transports: bool = False) -> list[str]:
    """A comma-separated list of execution modes; with ``transports`` each may name the
    transport it forces, ``MODE@TRANSPORT`` (the layer benchmark across ranks)."""
    from megamoe_rt.modes.base import TRANSPORT_CHOICES
    from megamoe_rt.modes.registry import MODES

    out = [m.strip() for m in text.split(",") if m.strip()]
    split = [m.partition("@") for m in out]
    bad = [
        m
        for m, (mode, at, transport) in zip(out, split)
        if mode not in MODES or (at and (not transports or transport not in TRANSPORT_CHOICES))
    ]
    if not out or bad:
        shape = f"{'|'.join(MODES)}[@{'|'.join(TRANSPORT_CHOICES)}]" if transports else ", ".join(MODES)
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {shape}, got {text!r}")
    return out


def chunk_ratio(text: str) -> float | str:
    """The layer's ``chunk_ratio``: a share in (0, 1] of the worst-case pool, or ``auto``."""
    if text == "auto":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'auto', got {text!r}") from None
    if not (math.isfinite(v) and 0.0 < v <= 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'auto', got {text!r}")
    return v


def stream_config(text: str):
    """``SLOTSxTOKENS``: the layer's ``streaming=StreamConfig(SLOTS, TOKENS)``."""
    from megamoe_rt.schedule.streaming import StreamConfig

    slots, sep, tokens = text.lower().partition("x")
    try:
        if not sep:
            raise ValueError
        return StreamConfig(positive_int(slots), positive_int(tokens))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected SLOTSxTOKENS (e.g. 4x512), got {text!r}") from None


def gemm_tiles(text: str) -> tuple[tuple[int, int, int], ...]:
    """``MxN[c2][,...]``: grouped-GEMM tiles the kernels are built for (``gemm_heuristics.TILES``,
    and ``PAIRED_TILES`` with ``c2``: CTA pairs sharing the A tile), as (M, N, CTAs per cluster)."""
    from megamoe_rt.kernels.gemm_heuristics import PAIRED_TILES, TILES

    names = {f"{m}x{n}": (m, n, 1) for m, n in TILES} | {f"{m}x{n}c2": (m, n, 2) for m, n in PAIRED_TILES}
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in names]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"expected tiles among {', '.join(names)}, got {text!r}")
    return tuple(names[t] for t in items)
