"""NVRTC compilation of ``cuda_src`` kernels for sm_90a, through the cubin cache.

A :class:`KernelSpec` names one instantiation: an entry file, the kernel's name
expression (template arguments written out, so NVRTC instantiates it and tells
us the lowered name), preprocessor defines, the header sets it needs and its
dynamic shared memory. :func:`compile_kernel` returns the cubin, the lowered
name and the ptxas resource report, from the cache when a verified entry exists.

NVRTC runs through cuda.core's ``Program`` (the lowered name from the ``ObjectCode``'s
symbol mapping, the log through ``logs``). The options stay written as NVRTC's command
line (:func:`build_options`): that list is the cache key's material and what
:class:`CompiledKernel` records; :func:`program_options` maps each one onto its
``ProgramOptions`` field, and cuda.core passes NVRTC the same options again.

The cache key hashes the entry source, every project header it or the spec's
pre-included headers reach through ``#include "..."`` (content), the versions of
the wheels external headers come from, the options and the NVRTC version.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megamoe_rt._version import __version__
from megamoe_rt.jit.cache import CubinCache
from megamoe_rt.jit.link import cuda_core, is_cuda_core_error, link_cubin, nvjitlink_version
from megamoe_rt.jit.paths import (
    cuda_src_dir,
    device_library_path,
    header_set_version,
    include_dirs,
    missing_header_message,
)
from megamoe_rt.jit.resources import KernelResources, parse_ptxas_report, ptxas_entry_names
from megamoe_rt.runtime.errors import NvrtcError

ARCH = "sm_90a"
CXX_STD = "c++17"
_CACHE_FORMAT = 2  # 2: the package version joined the key


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant of a kernel family."""

    name: str  # unique, human-readable: "quantize_fp8[bf16]"
    source: str  # entry file, relative to cuda_src/
    entry: str  # name expression: "megamoe_rt::quantize_fp8_1x128<true>"
    defines: tuple[tuple[str, str], ...] = ()
    needs: tuple[str, ...] = ()  # header sets: "cuda", "cccl", "cutlass"
    dynamic_smem_bytes: int = 0
    block_threads: int = 0  # informational, for reports
    extra_options: tuple[str, ...] = ()
    expect_sass: tuple[str, ...] = ()  # opcodes the SASS must contain (checked by tests)
    uses_printf: bool = False  # a diagnostic printf: a small stack frame for its arguments is expected
    includes: tuple[str, ...] = ()  # headers (relative to cuda_src/) compiled in ahead of the entry file
    # Device libraries linked into the kernel (megamoe_rt.jit.paths.device_libraries, e.g.
    # "nvshmem"): compiled with -rdc=true, then linked by nvJitLink (megamoe_rt.jit.link). The
    # library's headers come with it.
    device_libraries: tuple[str, ...] = ()
    # The kernel's parameters in order, as the ctypes types a launch passes (a parameter
    # struct, tensor maps, scalars). Loading checks them against the driver's parameter
    # sizes once (megamoe_rt.kernels.loader); empty: not checked.
    params: tuple[type, ...] = ()


@dataclass(frozen=True)
class CompiledKernel:
    spec: KernelSpec
    cubin: bytes
    lowered_name: str
    resources: KernelResources
    log: str
    cache_key: str
    from_cache: bool
    compile_seconds: float = 0.0
    options: tuple[str, ...] = field(default=())


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library (part of every cache key). cuda.core has no public
    query for it, so it comes from cuda.bindings, the library cuda.core's Program runs."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError("nvrtcVersion", getattr(err, "name", str(err)))
    return int(major), int(minor)


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def project_headers(entry: Path, root: Path) -> dict[str, str]:
    """Every project header reachable from ``entry`` by quoted includes -> sha256.

    Quoted includes resolve against the including file's directory, then
    cuda_src/ (the only project include path). Angle includes are external
    headers, keyed by wheel version instead.
    """
    found: dict[str, str] = {}
    stack = [entry]
    while stack:
        path = stack.pop()
        text = path.read_text()
        for inc in _INCLUDE.findall(text):
            for base in (path.parent, root):
                cand = (base / inc).resolve()
                if cand.is_file():
                    rel = os.path.relpath(cand, root)
                    if rel not in found:
                        found[rel] = hashlib.sha256(cand.read_bytes()).hexdigest()
                        stack.append(cand)
                    break
            else:
                raise FileNotFoundError(f'{path.name}: #include "{inc}" not found under {root}')
    return dict(sorted(found.items()))


def build_options(spec: KernelSpec, *, lineinfo: bool) -> tuple[list[str], dict[str, str]]:
    """NVRTC options and the external header sets (name -> version) they bring in."""
    dirs = include_dirs()
    opts = [f"--gpu-architecture={ARCH}", f"--std={CXX_STD}", "--ptxas-options=-v", f"-I{cuda_src_dir()}"]
    external = {}
    for need in (*spec.needs, *(lib for lib in spec.device_libraries if lib not in spec.needs)):
        if need not in dirs:
            raise ValueError(f"kernel {spec.name}: unknown header set {need!r}")
        if dirs[need] is None:
            raise RuntimeError(f"kernel {spec.name}: " + missing_header_message(need))
        opts.append(f"-I{dirs[need]}")
        external[need] = header_set_version(need)
    if spec.device_libraries:
        opts.append("--relocatable-device-code=true")
    if "nvshmem" in spec.device_libraries:
        # NVSHMEM's device headers before 3.8 declare a constructor with no execution space
        # (nvshmem_tensor.h), which NVRTC refuses unless unannotated functions are __device__;
        # every function of ours is annotated (common/nvshmem_device_api.cuh).
        opts.append("-default-device")
    if lineinfo:
        opts.append("-lineinfo")
    opts.extend(f"--pre-include={inc}" for inc in spec.includes)
    for k, v in spec.defines:
        opts.append(f"-D{k}={v}")
    opts.extend(spec.extra_options)
    return opts, external


def cache_key(spec: KernelSpec, options: list[str], external: dict[str, str]) -> tuple[str, dict]:
    root = cuda_src_dir()
    entry = root / spec.source
    # Absolute include paths vary between machines and say nothing about content.
    portable_opts = [o for o in options if not o.startswith("-I")]
    headers = project_headers(entry, root)
    for inc in spec.includes:
        # Pre-included headers count like included ones, with everything they include.
        path = root / inc
        if not path.is_file():
            raise FileNotFoundError(f"kernel {spec.name}: pre-included header {inc!r} not found under {root}")
        headers[os.path.relpath(path.resolve(), root)] = hashlib.sha256(path.read_bytes()).hexdigest()
        headers.update(project_headers(path, root))
    material = {
        "format": _CACHE_FORMAT,
        "package": __version__,
        "entry_file": spec.source,
        "entry_sha256": hashlib.sha256(entry.read_bytes()).hexdigest(),
        "headers": dict(sorted(headers.items())),
        "external_headers": external,
        "name_expression": spec.entry,
        "options": portable_opts,
        "nvrtc": list(nvrtc_version()),
        # cuda.core turns the options into NVRTC's command line: another release may spell them
        # (or add defaults) differently, so its cubins are not this one's.
        "cuda_core": cuda_core_version(),
    }
    if spec.device_libraries:  # the library's version is its header set's (external above)
        material["device_libraries"] = sorted(spec.device_libraries)
        material["nvjitlink"] = list(nvjitlink_version())
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return digest[:40], material


@functools.cache
def cuda_core_version() -> str:
    """The installed cuda-core's version ("" where its distribution metadata is missing)."""
    from importlib import metadata

    try:
        return metadata.version("cuda-core")
    except metadata.PackageNotFoundError:
        return str(getattr(cuda_core(), "__version__", ""))


def _library_paths(spec: KernelSpec) -> list[Path]:
    out = []
    for lib in spec.device_libraries:
        path = device_library_path(lib)
        if path is None:
            raise RuntimeError(
                f"kernel {spec.name}: " + missing_header_message(lib).replace("headers", "device library")
            )
        out.append(path)
    return out


def _lineinfo_default() -> bool:
    return os.environ.get("MEGAMOE_RT_LINEINFO", "0") not in ("", "0", "false", "no")


def compile_kernel(
    spec: KernelSpec, *, lineinfo: bool | None = None, cache: CubinCache | None = None, use_cache: bool = True
) -> CompiledKernel:
    lineinfo = _lineinfo_default() if lineinfo is None else lineinfo
    options, external = build_options(spec, lineinfo=lineinfo)
    key, material = cache_key(spec, options, external)
    if not use_cache:
        return _build(spec, options, key, material, None)
    cache = cache if cache is not None else CubinCache()
    hit = _cached(spec, options, key, cache)
    if hit is not None:
        return hit
    with cache.building(key):  # another process may be building it: then it is there after the wait
        hit = _cached(spec, options, key, cache)
        return hit if hit is not None else _build(spec, options, key, material, cache)


def _cached(spec: KernelSpec, options: list[str], key: str, cache: CubinCache) -> CompiledKernel | None:
    hit = cache.load(key)
    if hit is None:
        return None
    try:
        res = KernelResources(**hit.meta["resources"])
        lowered = hit.meta["lowered_name"]
        if not isinstance(lowered, str):
            raise TypeError("lowered_name")
        return CompiledKernel(
            spec, hit.cubin, lowered, res, str(hit.meta.get("log", "")), key, True, 0.0, tuple(options)
        )
    except (KeyError, TypeError):  # an entry of another layout: rebuild it
        cache.reject(key)
        return None


def _build(spec: KernelSpec, options: list[str], key: str, material: dict, cache: CubinCache | None) -> CompiledKernel:
    t0 = time.perf_counter()
    cubin, lowered, log = _nvrtc_compile(spec, options)
    cubin, res = _cubin_with_resources(spec, options, cubin, lowered, log)
    if spec.device_libraries:
        cubin = link_cubin(cubin, _library_paths(spec), arch=ARCH, name=spec.name)
    seconds = time.perf_counter() - t0
    if cache is not None:
        cache.store(
            key,
            cubin,
            {
                "name": spec.name,
                "lowered_name": lowered,
                "log": log,
                "resources": {k: v for k, v in res.as_dict().items() if k not in ("spill_bytes", "smem_bytes")},
                "material": material,
                "compile_seconds": round(seconds, 3),
            },
        )
    return CompiledKernel(spec, cubin, lowered, res, log, key, False, seconds, tuple(options))


# NVRTC 13.0 keeps a cache of PTX -> cubin keyed by the PTX and the ptxas options;
# a hit skips ptxas and so leaves the log without its -v report (or with a report
# of other entries only). Reports are remembered by cubin digest and entry (same PTX
# and options, same cubin), for every entry of a report: kernels that share one
# source file share its PTX, so the first of them brings the report for all the
# others. A miss there recompiles with a codegen-neutral extra ptxas option to force
# a fresh ptxas run, and keeps that run's cubin and report together (the cubin
# records its ptxas options, so its bytes differ). A second neutral option covers a
# retry that hits the cache too. Four ranks building the same kernel at once saw
# an empty log from all three runs (cause not pinned down: NVRTC may share its cache
# between processes); the cubin cache's build lock now makes one process build each
# entry while the others wait for it.
_reports: dict[tuple[str, str], KernelResources] = {}
_REPORT_RETRY_OPTIONS = ("--ptxas-options=-O3", "--ptxas-options=--allow-expensive-optimizations=true")


def _remember_report(cubin: bytes, log: str) -> None:
    digest = hashlib.sha256(cubin).hexdigest()
    for entry in ptxas_entry_names(log):
        _reports[(digest, entry)] = parse_ptxas_report(log, entry, name=entry)


def _cubin_with_resources(
    spec: KernelSpec, options: list[str], cubin: bytes, lowered: str, log: str
) -> tuple[bytes, KernelResources]:
    first_cubin = cubin
    if lowered not in ptxas_entry_names(log):
        known = _reports.get((hashlib.sha256(cubin).hexdigest(), lowered))
        if known is not None:
            return cubin, dataclasses.replace(known, name=spec.name, dynamic_smem_bytes=spec.dynamic_smem_bytes)
        for retry in _REPORT_RETRY_OPTIONS:
            cubin, lowered, log = _nvrtc_compile(spec, options + [retry])
            if lowered in ptxas_entry_names(log):
                break
        else:
            raise RuntimeError(
                f"kernel {spec.name}: ptxas gave no resource report for {lowered!r}, also when run again with "
                f"{' or '.join(_REPORT_RETRY_OPTIONS)}; NVRTC log:\n{log[:4000]}"
            )
    res = parse_ptxas_report(log, lowered, name=spec.name, dynamic_smem_bytes=spec.dynamic_smem_bytes)
    _remember_report(cubin, log)
    if cubin is not first_cubin:  # a retry: its report serves the first build's cubin too
        _remember_report(first_cubin, log)
    return cubin, res


# NVRTC's spellings of the options build_options writes (and KernelSpec.extra_options may
# add) -> the ProgramOptions field cuda.core writes each with. Prefixed options carry a
# value; the list ones may repeat and keep their order (include paths are searched in it).
_VALUE_OPTIONS = {"--gpu-architecture=": "arch", "--std=": "std"}
_LIST_OPTIONS = {
    "--ptxas-options=": "ptxas_options",
    "-I": "include_path",
    "--pre-include=": "pre_include",
    "-D": "define_macro",  # "NAME=VALUE" as it stands: cuda.core writes --define-macro=NAME=VALUE
}
_FLAG_OPTIONS = {
    "--relocatable-device-code=true": "relocatable_device_code",
    "-default-device": "device_as_default_execution_space",
    "-lineinfo": "lineinfo",
}


def program_options(options: Sequence[str], *, name: str) -> Any:
    """``options`` (NVRTC's command line, as :func:`build_options` writes it) as cuda.core
    ``ProgramOptions`` for a program called ``name``. ProgramOptions takes no raw option, so
    one with no field mapped here is refused (ValueError naming it)."""
    fields: dict[str, Any] = {"name": name}
    lists: dict[str, list[str]] = {}
    for opt in options:
        if opt in _FLAG_OPTIONS:
            fields[_FLAG_OPTIONS[opt]] = True
            continue
        prefix = next((p for p in (*_VALUE_OPTIONS, *_LIST_OPTIONS) if opt.startswith(p) and len(opt) > len(p)), None)
        if prefix is None:
            raise ValueError(f"NVRTC option {opt!r}: megamoe_rt maps no cuda.core ProgramOptions field to it")
        if prefix in _VALUE_OPTIONS:
            fields[_VALUE_OPTIONS[prefix]] = opt[len(prefix) :]
        else:
            lists.setdefault(_LIST_OPTIONS[prefix], []).append(opt[len(prefix) :])
    return cuda_core().ProgramOptions(**fields, **lists)


def _nvrtc_failure(exc: BaseException) -> tuple[str, str]:
    """cuda.core's NVRTCError as (NVRTC's result name, the compile log): its message is the
    result, then ``, compilation log:``, a blank line and the log (the only place cuda.core
    hands a failed compile's log)."""
    head, _, log = str(exc).partition(", compilation log:\n\n")
    result = re.search(r"NVRTC_[A-Z_]+", head)
    return (result.group(0) if result else head.strip()), log.rstrip("\0")


def _program_log(program: Any) -> str:
    """The log NVRTC kept for ``program`` ("" where it cannot be read): a failed compile's log
    does not depend on how a cuda.core release words its error."""
    try:
        from cuda.bindings import nvrtc

        err, size = nvrtc.nvrtcGetProgramLogSize(program.handle)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
            return ""
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(program.handle, buf)
    except Exception:  # a backend or binding without the call: the error text's log stands
        return ""
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return ""
    return buf.rstrip(b"\0").decode(errors="replace")


def _nvrtc_compile(spec: KernelSpec, options: list[str]) -> tuple[bytes, str, str]:
    """One NVRTC run (cuda.core Program): the cubin, the lowered name and the log."""
    core = cuda_core()
    entry = cuda_src_dir() / spec.source
    # The program is named by the entry's path (quoted includes resolve against its directory);
    # the source goes in byte for byte (read_text would translate line endings).
    src = entry.read_bytes().decode()
    what = f"{spec.source} ({spec.name})"
    opts = program_options(options, name=str(entry))
    try:
        program = core.Program(src, "c++", opts)
    except Exception as exc:
        if not is_cuda_core_error(exc):
            raise
        raise NvrtcError("nvrtcCreateProgram", _nvrtc_failure(exc)[0], "", spec.source) from None
    log = io.StringIO()
    try:
        obj = program.compile("cubin", name_expressions=(spec.entry,), logs=log)
    except Exception as exc:
        if not is_cuda_core_error(exc):
            raise
        result, text = _nvrtc_failure(exc)
        text = _program_log(program) or text  # from NVRTC itself where it can be read
        raise NvrtcError("nvrtcCompileProgram" if text else "Program.compile", result, text, what) from None
    finally:
        program.close()
    lowered = obj.symbol_mapping.get(spec.entry)
    if lowered is None:
        raise NvrtcError("nvrtcGetLoweredName", "no lowered name", f"name expression {spec.entry!r}", what)
    lowered = lowered.decode() if isinstance(lowered, bytes) else str(lowered)
    return bytes(obj.code), lowered, log.getvalue().rstrip("\0")
