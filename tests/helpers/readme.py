"""The README's fenced blocks as commands to run (tests/cpu/test_readme.py, tests/gpu/test_readme_gpu.py)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def readme_blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def readme_commands() -> list[str]:
    """Every shell command of the README, except installing and the test run this file is part of."""
    commands = []
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if not line or line.startswith("#") or line.startswith("pip ") or "pytest" in line:
                continue
            commands.append(line)
    return commands


def as_argv(command: str) -> list[str]:
    """The command under this interpreter: `megamoe-rt ...` is `python -m megamoe_rt ...`."""
    argv = shlex.split(command)
    if argv[0] == "megamoe-rt":
        return [sys.executable, "-m", "megamoe_rt", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"README command {command!r}: not a megamoe-rt or python command")


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd)
