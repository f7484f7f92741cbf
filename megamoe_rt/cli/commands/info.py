"""``megamoe-rt info``: package, compiler and driver versions; GPUs; NVSHMEM; cache."""

from __future__ import annotations

import argparse
import platform
from typing import Any

from megamoe_rt.cli.output import add_output_options, check_output, emit


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    s = subparsers.add_parser("info", help="package, compiler and driver versions; GPUs; NVSHMEM; cache")
    add_output_options(s, "the report")
    s.set_defaults(func=run)
    return s


def _dist_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _nvshmem_status() -> str:
    import importlib.util

    host = "nvshmem4py " + (_dist_version("nvshmem4py-cu13") or _dist_version("nvshmem4py-cu12") or "missing")
    lib = _dist_version("nvidia-nvshmem-cu13") or _dist_version("nvidia-nvshmem-cu12")
    found = importlib.util.find_spec("nvshmem") is not None
    return f"{'available' if found and lib else 'not available'} ({host}, nvidia-nvshmem {lib or 'missing'})"


def info_report() -> tuple[list[tuple[str, str]], dict]:
    """What ``megamoe-rt info`` reports: its table's rows, and the same as JSON (``--json``)."""
    from megamoe_rt import __version__
    from megamoe_rt.jit import CubinCache, include_dirs
    from megamoe_rt.runtime import devices, driver

    versions = {
        "megamoe_rt": __version__,
        "python": platform.python_version(),
        "numpy": _dist_version("numpy"),
        "ml_dtypes": _dist_version("ml-dtypes") or _dist_version("ml_dtypes"),
        "cuda-bindings": _dist_version("cuda-bindings"),
        "cupy": _dist_version("cupy-cuda13x") or _dist_version("cupy-cuda12x"),
        "cuda-core": _dist_version("cuda-core"),
    }
    rows: list[tuple[str, str]] = [(k, v or "missing") for k, v in versions.items()]
    result: dict = {"versions": versions}
    try:
        from megamoe_rt.jit import nvrtc_version

        result["nvrtc"] = "{}.{}".format(*nvrtc_version())
        rows.append(("nvrtc", result["nvrtc"]))
    except Exception as exc:
        result["nvrtc"] = None
        rows.append(("nvrtc", f"unavailable ({type(exc).__name__})"))
    result["headers"] = {name: str(path) if path else None for name, path in include_dirs().items()}
    rows += [(f"headers[{name}]", path or "not found") for name, path in result["headers"].items()]
    result["nvshmem"] = _nvshmem_status()
    rows.append(("nvshmem", result["nvshmem"]))
    cache = CubinCache()
    result["cache"] = {"directory": str(cache.directory), "entries": len(cache.entries())}
    rows.append(("cache", f"{cache.directory} ({result['cache']['entries']} entries)"))
    ver = devices.driver_version()
    result["driver_cuda"] = "{}.{}".format(*ver) if ver else None  # the CUDA version the driver supports
    rows.append(("driver", f"CUDA {result['driver_cuda']}" if ver else "not found"))
    gpus = []
    if ver:
        try:
            gpus = devices.list_devices()
        except driver.GpuUnavailableError as exc:  # e.g. cuda-core missing: say why, keep the report
            rows.append(("gpus", str(exc)))
            result["gpus_unavailable"] = str(exc)
    result["gpus"] = [
        {
            "ordinal": d.ordinal,
            "name": d.name,
            "sm_count": d.sm_count,
            "compute_capability": "{}.{}".format(*d.compute_capability),
            "total_memory_bytes": d.total_memory_bytes,
            "l2_cache_bytes": d.l2_cache_bytes,
            "is_hopper": d.is_hopper,
        }
        for d in gpus
    ]
    return rows, result


def run(args: argparse.Namespace) -> int:
    check_output("megamoe-rt info", args)
    rows, result = info_report()
    emit(args, result)
    if args.json:
        return 0
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not result["gpus"]:
        print("gpus" + " " * (width - 2) + "none")
    for d in result["gpus"]:
        mark = "" if d["is_hopper"] else "  (not sm_90: GPU paths unavailable)"
        print(
            f"gpu {d['ordinal']}: {d['name']}, {d['sm_count']} SMs, compute capability {d['compute_capability']}, "
            f"{d['total_memory_bytes'] / 2**30:.0f} GiB, L2 {d['l2_cache_bytes'] / 2**20:.0f} MiB{mark}"
        )
    return 0
