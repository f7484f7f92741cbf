"""Per-kernel resource usage, parsed from ptxas' verbose report (``-Xptxas -v``)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    static_smem_bytes: int
    dynamic_smem_bytes: int
    barriers: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    @property
    def smem_bytes(self) -> int:
        return self.static_smem_bytes + self.dynamic_smem_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["spill_bytes"] = self.spill_bytes
        d["smem_bytes"] = self.smem_bytes
        return d


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_entry_names(log: str) -> list[str]:
    """Lowered names of every entry function ptxas reported on in ``log``, in order."""
    return [m.group(1) for m in _ENTRY.finditer(log)]


def parse_ptxas_report(log: str, lowered_name: str, *, name: str, dynamic_smem_bytes: int = 0) -> KernelResources:
    """Resources of entry ``lowered_name`` from an NVRTC log; ValueError if it is absent.

    ptxas prints, per entry: 'Compiling entry function', then 'Function properties'
    with the stack frame and spills, then 'Used N registers, ... N bytes smem'.
    """
    lines = log.splitlines()
    start = None
    for i, line in enumerate(lines):
        m = _ENTRY.search(line)
        if m and m.group(1) == lowered_name:
            start = i
            break
    if start is None:
        raise ValueError(f"ptxas report has no entry for {lowered_name!r} (was -Xptxas -v passed?)")
    frame: tuple[int, ...] = (0, 0, 0)
    regs: int | None = None
    barriers = smem = 0  # set with regs; unread unless regs is
    in_own_props = False
    for line in lines[start + 1 :]:
        if _ENTRY.search(line):
            break
        m = _PROPS.search(line)
        if m:
            in_own_props = m.group(1) == lowered_name
            continue
        m = _FRAME.search(line)
        if m and in_own_props:
            frame = tuple(int(g) for g in m.groups())
            continue
        m = _USED.search(line)
        if m:
            regs = int(m.group(1))
            b = _BARRIERS.search(line)
            s = _SMEM.search(line)
            barriers = int(b.group(1)) if b else 0
            smem = int(s.group(1)) if s else 0
            break
    if regs is None:
        raise ValueError(f"ptxas report for {lowered_name!r} has no 'Used N registers' line")
    return KernelResources(
        name=name,
        registers=regs,
        stack_frame_bytes=frame[0],
        spill_store_bytes=frame[1],
        spill_load_bytes=frame[2],
        static_smem_bytes=smem,
        dynamic_smem_bytes=int(dynamic_smem_bytes),
        barriers=barriers,
    )
