"""``python -m megamoe_rt.kernels.interface [--check]``: regenerate cuda_src/interface/*.cuh."""

from __future__ import annotations

import argparse
import sys

from megamoe_rt.kernels.interface.generate import REGENERATE, stale, write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megamoe_rt.kernels.interface",
                                 description="Write the C++ headers generated from the kernel interface declarations.")
    ap.add_argument("--check", action="store_true", help="only list the generated files that are out of date")
    args = ap.parse_args(argv)
    if args.check:
        out = stale()
        for p in out:
            print(f"out of date: cuda_src/{p}")
        if out:
            print(f"run: {REGENERATE}")
        return 1 if out else 0
    changed = write()
    for p in changed:
        print(f"wrote cuda_src/{p}")
    if not changed:
        print("cuda_src/interface is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
