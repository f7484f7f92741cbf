"""``megamoe-rt compile``: build kernel variants into the cache and print their resources."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from megamoe_rt.cli.output import add_output_options, check_output, emit
from megamoe_rt.cli.usage import UsageError, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    s = subparsers.add_parser("compile", help="build kernel variants into the cache and print their resources")
    s.add_argument("names", nargs="*", help="kernel variant names")
    s.add_argument("--all", action="store_true", help="every kernel variant")
    add_output_options(s, "the kernels' resources (instead of the table)")
    s.add_argument("--lineinfo", action="store_true", help="compile with -lineinfo")
    s.add_argument("--no-cache", action="store_true", help="compile even where a cached cubin exists")
    s.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        default=None,
        help="build in this many processes (default: the usable cores; 1: in this process)",
    )
    s.add_argument("--list", action="store_true", help="print the kernel variant names, one a line, and exit")
    s.add_argument(
        "--sass-digest",
        action="store_true",
        help="also a digest of each kernel's SASS instructions: equal before and after a change that must "
        "leave the code as it was (needs cuobjdump: pip install 'megamoe-rt[test]')",
    )
    s.set_defaults(func=run)
    return s


def run(args: argparse.Namespace) -> int:
    from megamoe_rt.kernels.registry import all_kernel_specs

    specs = all_kernel_specs()
    if args.list:
        if args.names or args.all:
            raise UsageError("megamoe-rt compile: --list takes no kernel names and no --all")
        print("\n".join(s.name for s in specs))
        return 0
    if args.all:
        chosen = specs
    else:
        if not args.names:
            raise UsageError("megamoe-rt compile: name kernels or pass --all (--list shows them)")
        by_name = {s.name: s for s in specs}
        unknown = [n for n in args.names if n not in by_name]
        if unknown:  # one line: up to three names near it (for a family's prefix, its first variants)
            import difflib

            name, known = unknown[0], list(by_name)
            near = [k for k in known if k.startswith(name)][:3] or difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean: {', '.join(near)}?" if near else ""
            raise UsageError(
                f"megamoe-rt compile: unknown kernel {name!r}{hint} (megamoe-rt compile --list shows all {len(known)})"
            )
        chosen = [by_name[n] for n in args.names]
    check_output("megamoe-rt compile", args)  # before the builds, which take a minute for --all
    if args.sass_digest:
        from megamoe_rt.jit.sass import find_cuobjdump

        if find_cuobjdump() is None:
            raise UsageError("megamoe-rt compile: --sass-digest needs cuobjdump (pip install 'megamoe-rt[test]')")
    from megamoe_rt.requirements import compiler_or_report

    if not compiler_or_report("megamoe-rt compile"):  # NVRTC or a header wheel missing: one line, not NVRTC's traceback
        return 1
    from megamoe_rt.cli.compile_kernels import build_kernels

    try:  # a progress line per kernel on stderr as it finishes; the results below in this order
        results = build_kernels(chosen, jobs=args.jobs, lineinfo=args.lineinfo, use_cache=not args.no_cache)
    except KeyboardInterrupt:  # the workers are ended: one line, no traceback
        print("megamoe-rt compile: interrupted", file=sys.stderr)
        return 130
    digests = _sass_digests(results) if args.sass_digest else {}
    if args.json or args.output:
        out = []
        for c in results:
            d = c.resources.as_dict()
            d.update(
                lowered_name=c.lowered_name,
                source=c.spec.source,
                cache_key=c.cache_key,
                from_cache=c.from_cache,
                compile_seconds=round(c.compile_seconds, 3),
                block_threads=c.spec.block_threads,
            )
            if digests:
                d["sass_digest"] = digests[c.spec.name]
            out.append(d)
        emit(args, out)
        if args.json:
            return 0
    header = f"{'kernel':<34} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem B':>8} {'cached':>7} {'sec':>6}"
    if digests:
        header += f"  {'sass digest':<16}"
    print(header)
    print("-" * len(header))
    for c in results:
        r = c.resources
        line = (
            f"{c.spec.name:<34} {r.registers:>5} {r.spill_bytes:>8} {r.stack_frame_bytes:>8} "
            f"{r.smem_bytes:>8} {'yes' if c.from_cache else 'no':>7} {c.compile_seconds:>6.2f}"
        )
        print(line + (f"  {digests[c.spec.name]}" if digests else ""))
    return 0


def _sass_digests(results: Any) -> dict[str, str]:
    """Kernel name -> digest of its SASS (jit.sass.sass_digest)."""
    from megamoe_rt.jit.sass import dump_sass, sass_digest

    return {c.spec.name: sass_digest(dump_sass(c.cubin)) for c in results}
