"""Integer rounding helpers shared by the whole package.

A leaf module: it imports nothing from megamoe_rt, so any module may use it without
creating an import cycle (tests/cpu/test_import_graph.py checks the package has none).
"""

from __future__ import annotations

__all__ = ["align_up", "ceil_div"]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0`` (exact: no floating point)."""
    return -(-a // b)


def align_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (``align > 0``)."""
    return ceil_div(n, align) * align
