"""cuda.core, imported on first use: it comes with the cu13/cu12 extras, and importing it costs
time that ``import megamoe_rt`` should not pay. One place says which version the package needs
(Program, ProgramOptions, Linker, ObjectCode, Device, Stream, Event and Buffer as used here);
each caller raises its own error type with the reason."""

from __future__ import annotations

from typing import Any

CORE_MIN = (1, 2)


def import_cuda_core() -> tuple[Any, str | None]:
    """``(cuda.core, None)``, or ``(None, why it cannot be used)``."""
    try:
        import cuda.core as core
    except ImportError as exc:
        return None, f"cuda-core is not importable ({exc})"
    try:
        too_old = tuple(int(p) for p in core.__version__.split(".")[:2]) < CORE_MIN
    except (AttributeError, ValueError):  # a development build: trust it
        too_old = False
    if too_old:
        return None, f"cuda-core {core.__version__} is too old; megamoe_rt needs cuda-core >= 1.2"
    return core, None
