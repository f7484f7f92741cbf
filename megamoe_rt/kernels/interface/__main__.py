"""``python -m megamoe_rt.kernels.interface [--check]``: regenerate the C++ headers in
cuda_src/interface/ and the host's ctypes module megamoe_rt/kernels/interface/structs.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megamoe_rt.kernels.interface.generate import REGENERATE, stale, write


def _shown(p: Path) -> str:
    rel = os.path.relpath(p)
    return p.as_posix() if rel.startswith("..") else rel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=REGENERATE,
        description="Write the files generated from the kernel interface declarations.",
    )
    ap.add_argument("--check", action="store_true", help="only list the generated files that are out of date")
    args = ap.parse_args(argv)
    if args.check:
        out = stale()
        for p in out:
            print(f"out of date: {_shown(p)}")
        if out:
            print(f"run: {REGENERATE}")
        return 1 if out else 0
    changed = write()
    for p in changed:
        print(f"{'wrote' if p.exists() else 'removed'} {_shown(p)}")
    if not changed:
        print("the generated interface files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
