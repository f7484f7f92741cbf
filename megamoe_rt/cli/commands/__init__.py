"""The ``megamoe-rt`` subcommands, one module each (``megamoe_rt.cli.main`` lists them, in the
order ``megamoe-rt --help`` shows them).

A command module has ``add_parser(subparsers)``, which adds its subcommand's parser (options,
help, defaults) with ``func=run``, and ``run(args)``, which runs it and returns the exit status;
a bad argument is a :class:`~megamoe_rt.cli.usage.UsageError` (one line, exit status 2, in
``megamoe_rt.cli.main``). The modules import little at the top: what a command runs is imported
in ``run``, so building the parser stays fast.
"""

from __future__ import annotations

from typing import Any


def hopper_or_none(command: str) -> Any:
    """The GPU ``megamoe-rt COMMAND`` runs on, or None after printing the one-line reason (exit
    status 1): the GPU stack missing, no driver, no Hopper GPU (megamoe_rt/requirements.py).
    The one GPU probe of the commands (the tests replace it here)."""
    from megamoe_rt.requirements import gpu_or_report

    return gpu_or_report(f"megamoe-rt {command}")
