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
