"""Where a command's result goes: one convention for every ``megamoe-rt`` command.

``--json`` prints the result as JSON on stdout and nothing else goes there: a report
command (info, plan, partitions, scaleout) leaves its table out, and the lines a long-running
command prints as it goes (bench, sweep, tune-split, demo, trace, the fault suite) go to stderr
(:func:`progress_to_stderr`). ``-o/--output FILE`` writes the same JSON to FILE, the table
printed as usual. Both may be given.

Every file a command will write is checked before the command does any work
(:func:`check_writable`): a directory that does not exist or cannot be written, or a directory
where the file should be, is a usage error naming the option and the path (one line on stderr,
exit status 2), not a traceback after minutes of GPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megamoe_rt.cli.usage import UsageError

OUTPUT_OPTION = "-o/--output"


def add_output_options(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    """``--json`` (print ``what`` as JSON on stdout) and ``-o/--output FILE`` (write it to FILE)."""
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as JSON on stdout (nothing else is printed there)"
    )
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help=f"write {what} as JSON to FILE")


def unwritable(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (a few words), or None when it can be."""
    p = Path(path)
    if not path or path.endswith(("/", os.sep)) or p.is_dir():
        return "is a directory"
    parent = p.parent
    if not parent.exists():
        return f"directory {parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if p.exists():
        return None if os.access(p, os.W_OK) else "is not writable"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"directory {parent} is not writable"


def check_writable(prog: str, option: str, path: str | None) -> None:
    """A :class:`UsageError` (``prog: option path: why``) when a file cannot be written at ``path``;
    nothing for None (the option not given)."""
    if path is None:
        return
    problem = unwritable(path)
    if problem is not None:
        raise UsageError(f"{prog}: {option} {path}: {problem}")


def check_output(prog: str, args: argparse.Namespace) -> None:
    """``-o/--output``, checked as :func:`check_writable` does, before the command's work."""
    check_writable(prog, OUTPUT_OPTION, getattr(args, "output", None))


def dumps(result: Any, indent: int | None = 2) -> str:
    return json.dumps(result, indent=indent)


def write_json(path: str, result: Any, indent: int | None = 2) -> None:
    """``result`` as JSON in ``path`` (the ``-o`` file), replaced whole each time."""
    with open(path, "w") as f:
        f.write(dumps(result, indent) + "\n")


def print_json(result: Any, indent: int | None = 2) -> None:
    """``result`` as JSON on stdout (``--json``)."""
    print(dumps(result, indent), flush=True)


def emit(args: argparse.Namespace, result: Any, *, indent: int | None = 2, written: bool = False) -> None:
    """The result where the options say: the ``-o`` file (unless the command already ``written``
    it, as the benchmarks do after every cell) and, with ``--json``, stdout."""
    if getattr(args, "output", None) and not written:
        write_json(args.output, result, indent)
    if getattr(args, "json", False):
        print_json(result, indent)


@contextlib.contextmanager
def progress_to_stderr(args: argparse.Namespace) -> Iterator[None]:
    """With ``--json``, what is printed inside goes to stderr, so that stdout holds the JSON alone."""
    if getattr(args, "json", False):
        with contextlib.redirect_stdout(sys.stderr):
            yield
    else:
        yield
