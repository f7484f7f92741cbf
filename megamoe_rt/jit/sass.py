"""SASS of a cubin, through cuobjdump from the nvidia-cuda-cuobjdump wheel."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def find_cuobjdump() -> str | None:
    for entry in sys.path:
        for rel in ("nvidia/cu13/bin/cuobjdump", "nvidia/cuda_cuobjdump/bin/cuobjdump"):
            p = Path(entry or ".") / rel
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return shutil.which("cuobjdump")


def dump_sass(cubin: bytes) -> str:
    tool = find_cuobjdump()
    if tool is None:
        raise RuntimeError(
            "cuobjdump was not found: install nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (pip install 'megamoe-rt[test]')"
        )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        # cuobjdump hands disassembly to nvdisasm, which the wheels install beside it.
        env = dict(os.environ)
        env["PATH"] = str(Path(tool).parent) + os.pathsep + env.get("PATH", "")
        out = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_opcodes(sass: str) -> set[str]:
    """Base opcodes (before the first '.') appearing in a SASS listing."""
    return {m.group(1).split(".")[0] for m in _OPCODE.finditer(sass)}


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*);")


def wgmma_issue_windows(sass: str) -> list[list[str]]:
    """Each wgmma issue sequence of a listing: the instructions from a ``WARPGROUP.ARRIVE`` to the
    ``QGMMA`` that closes its group (``gsb0``), without their predicates."""
    windows: list[list[str]] = []
    current: list[str] | None = None
    for m in _INSTRUCTION.finditer(sass):
        text = " ".join(m.group(1).split())
        if text.startswith("WARPGROUP.ARRIVE"):
            current = [text]
        elif current is not None:
            current.append(text)
            if text.startswith("QGMMA") and "gsb0" in text:
                windows.append(current)
                current = None
    return windows


_GDESC = re.compile(r"gdesc\[UR(\d+)\]")
_R2UR_DEST = re.compile(r"^R2UR UR(\d+),")


def descriptors_moved_from_vector_registers(window: list[str]) -> list[str]:
    """The ``R2UR`` moves of a wgmma issue window (wgmma_issue_windows) that write a uniform
    register one of its ``QGMMA`` reads as a descriptor (``gdesc[URn]``: URn..URn+3): a
    descriptor computed in ordinary registers, moved over on the issue path."""
    read: set[int] = set()
    for text in window:
        m = _GDESC.search(text) if text.startswith("QGMMA") else None
        if m:
            read.update(range(int(m.group(1)), int(m.group(1)) + 4))
    return [t for t in window if (m := _R2UR_DEST.match(t)) and int(m.group(1)) in read]
