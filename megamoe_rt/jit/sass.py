"""SASS and kernel parameters of a cubin, through cuobjdump from the nvidia-cuda-cuobjdump wheel."""

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


def _cuobjdump(cubin: bytes, option: str) -> str:
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
        out = subprocess.run([tool, option, str(path)], capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump {option} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def dump_sass(cubin: bytes) -> str:
    return _cuobjdump(cubin, "-sass")


_KPARAM = re.compile(
    r"EIATTR_KPARAM_INFO.*?Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x([0-9a-f]+)\s+Size\s*:\s*0x([0-9a-f]+)", re.S
)


def cubin_param_layout(cubin: bytes, lowered_name: str) -> dict[int, tuple[int, int]]:
    """The parameters of kernel ``lowered_name`` as its cubin's ELF records them
    (``EIATTR_KPARAM_INFO`` in ``.nv.info.<name>``): ordinal -> (offset, size) in bytes. What
    the driver's parameter query answers once the kernel is loaded
    (megamoe_rt.kernels.loader.check_param_sizes takes either), without a GPU."""
    listing = _cuobjdump(cubin, "-elf")
    # The listing prints each section after a line with its name alone.
    sections = re.split(r"^(\.\S+)\s*$", listing, flags=re.M)
    found: dict[int, tuple[int, int]] = {}
    for name, body in zip(sections[1::2], sections[2::2]):
        if name == f".nv.info.{lowered_name}":
            found.update({int(o, 16): (int(off, 16), int(size, 16)) for o, off, size in _KPARAM.findall(body)})
    if not found:
        raise RuntimeError(f"cuobjdump -elf: no parameter records for {lowered_name}")
    return found


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
_UNIFORM_DEST = re.compile(r"^(\S+) UR(\d+),")


def descriptors_moved_from_vector_registers(window: list[str]) -> list[str]:
    """The ``R2UR`` moves of a wgmma issue window (wgmma_issue_windows) whose value a ``QGMMA`` of
    the window reads as a descriptor (``gdesc[URn]``: URn..URn+3, as last written before it): a
    descriptor computed in ordinary registers and moved over on the issue path. A uniform register
    that an R2UR filled for something else (a load's memory descriptor) and that is written again
    before the QGMMA does not count."""
    last_writer: dict[int, str] = {}
    moved: list[str] = []
    for text in window:
        if text.startswith("QGMMA"):
            m = _GDESC.search(text)
            if m:
                base = int(m.group(1))
                for reg in range(base, base + 4):
                    writer = last_writer.get(reg, "")
                    if writer.startswith("R2UR") and writer not in moved:
                        moved.append(writer)
            continue
        m = _UNIFORM_DEST.match(text)
        if m:
            first = int(m.group(2))
            width = 2 if ".64" in m.group(1) else 1
            for reg in range(first, first + width):
                last_writer[reg] = text
    return moved


_EVERY_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);")


def sass_digest(sass: str) -> str:
    """A digest of a listing's instructions (predicates, operands and branch targets included;
    the encodings and cuobjdump's headers left out): equal for two builds that run the same
    code, so a change meant to leave a kernel as it was (a refactor) can be checked without a
    GPU (``megamoe-rt compile --sass-digest``)."""
    import hashlib

    text = "\n".join(" ".join(m.group(1).split()) for m in _EVERY_INSTRUCTION.finditer(sass))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
