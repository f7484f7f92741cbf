"""What an entry point that cannot run must print: one line, exit status 1, no traceback."""

from __future__ import annotations

import subprocess

# The install command the line of a missing GPU stack names (megamoe_rt/runtime/errors.py).
INSTALL = 'pip install "megamoe-rt[cu13]"'


def the_one_line(what: str, out: subprocess.CompletedProcess) -> str:
    """The single line ``out`` printed (stdout and stderr together), after checking it is the
    only one, that the exit status is 1 and that no traceback came with it."""
    text = out.stdout + out.stderr
    assert "Traceback" not in text, f"{what}: a traceback\n{text}"
    assert out.returncode == 1, f"{what}: exit status {out.returncode}, expected 1\n{text}"
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"{what}: {len(lines)} lines where one should say what is missing\n{text}"
    return lines[0]
