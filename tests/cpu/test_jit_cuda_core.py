"""Kernels built through cuda.core's Program are what NVRTC builds (CPU only): the same cubin
and lowered name as NVRTC's own API gives for the same options, a lowered name that demangles
to the spec's entry, a resource report that matches the cubin's own (cuobjdump), and every
option handed to cuda.core reaching NVRTC."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from megamoe_rt.jit import CubinCache, compile_kernel
from megamoe_rt.jit import compiler as jit_compiler
from megamoe_rt.jit.sass import find_cuobjdump
from megamoe_rt.kernels.probe import NVSHMEM_LINK_SPEC
from megamoe_rt.kernels.registry import all_kernel_specs

BY_NAME = {s.name: s for s in all_kernel_specs()}
# Kernel -> the start of its lowered name demangled (written out from the spec's entry: the
# enum argument as the demangler prints it, kContiguous being GroupLayout's first value).
CASES = {
    "quantize_fp8_1x128[bf16]": "void megamoe_rt::quantize_fp8_1x128<true>(",
    "fp8_gemm_check_group_layout": "megamoe_rt::gemm::check_group_layout(",  # no template: no return type
    "fp8_gemm[contiguous,bf16,128x128,c1,s6,asf128,bsf128,osf128]": (
        "void megamoe_rt::gemm::sm90_fp8_grouped_gemm<128u, 128u, 6u, 128u, 128u, 128u, 1u, "
        "(megamoe_rt::gemm::GroupLayout)0, megamoe_rt::gemm::StoreBf16Epilogue>("
    ),
}


def _nvrtc_directly(spec, options: list[str]) -> tuple[bytes, str]:
    """The cubin and lowered name from NVRTC's C API (cuda.bindings), as megamoe_rt called it
    before cuda.core: the program named by the entry's path, one name expression."""
    from cuda.bindings import nvrtc

    entry = jit_compiler.cuda_src_dir() / spec.source
    err, prog = nvrtc.nvrtcCreateProgram(entry.read_bytes(), str(entry).encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        name = spec.entry.encode()
        assert nvrtc.nvrtcAddNameExpression(prog, name)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
        opts = [o.encode() for o in options]
        assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
        err, lowered = nvrtc.nvrtcGetLoweredName(prog, name)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        assert nvrtc.nvrtcGetCUBIN(prog, cubin)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, lowered.decode() if isinstance(lowered, bytes) else str(lowered)


def _demangle(name: str) -> str:
    """``name`` demangled by the C++ runtime's own demangler (``abi::__cxa_demangle``)."""
    found = ctypes.util.find_library("stdc++")
    if found is None:
        pytest.skip("libstdc++ (its __cxa_demangle) not found")
    demangle = ctypes.CDLL(found).__cxa_demangle
    demangle.restype = ctypes.c_void_p
    demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    status = ctypes.c_int()
    out = demangle(name.encode(), None, None, ctypes.byref(status))
    assert status.value == 0 and out, f"{name!r} does not demangle (status {status.value})"
    try:
        return ctypes.string_at(out).decode()
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(out))


def _resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """cuobjdump -res-usage of ``cubin``: lowered name -> {"REG": .., "STACK": .., ...}."""
    tool = find_cuobjdump()
    assert tool is not None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return {
        m.group(1): {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", m.group(2))}
        for m in re.finditer(r"Function (\S+):\n(.*)", text)
    }


@pytest.mark.parametrize("name", CASES)
def test_cuda_core_gives_nvrtcs_cubin_and_lowered_name(name):
    spec = BY_NAME[name]
    options, _ = jit_compiler.build_options(spec, lineinfo=False)
    cubin, lowered, log = jit_compiler._nvrtc_compile(spec, options)
    # One process: NVRTC's names for internal-linkage symbols carry the process id.
    assert (cubin, lowered) == _nvrtc_directly(spec, options)
    assert _demangle(lowered).startswith(CASES[name]), _demangle(lowered)
    assert lowered.encode() in cubin


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump wheel not installed")
@pytest.mark.parametrize("name", CASES)
def test_the_resource_report_is_the_cubins_own(name, tmp_path):
    built = compile_kernel(BY_NAME[name], cache=CubinCache(tmp_path / "cache"))
    usage = _resource_usage(built.cubin)[built.lowered_name]
    r = built.resources
    # Shared memory is left out: cuobjdump counts 1 KiB in the GEMM's .nv.shared section that
    # ptxas' report does not (it reports no static shared memory for it).
    assert (r.registers, r.stack_frame_bytes) == (usage["REG"], usage["STACK"])
    assert r.registers > 0 and r.spill_bytes == 0 and usage["LOCAL"] == 0


# Each option build_options writes, and the spelling cuda.core passes NVRTC for it: the same
# option. Pinned here because the cache key hashes build_options' list, not cuda.core's.
_CUDA_CORE_SPELLING = {
    "--gpu-architecture=": "-arch=",
    "--std=": "--std=",
    "--ptxas-options=": "--ptxas-options=",
    "-I": "--include-path=",
    "--pre-include=": "--pre-include=",
    "-D": "--define-macro=",
    "--relocatable-device-code=true": "--relocatable-device-code=true",
    "-default-device": "--device-as-default-execution-space",
    "-lineinfo": "--generate-line-info",
}


def _cuda_core_spelling(option: str) -> str:
    for ours in sorted(_CUDA_CORE_SPELLING, key=len, reverse=True):
        if option == ours or (ours.endswith(("=", "I", "D")) and option.startswith(ours)):
            return _CUDA_CORE_SPELLING[ours] + option[len(ours) :]
    raise AssertionError(option)


@pytest.mark.parametrize(
    "spec",
    [NVSHMEM_LINK_SPEC, BY_NAME["fp8_gemm[contiguous,bf16,128x128,c1,s6,asf128,bsf128,osf128]"]],
    ids=lambda s: s.name,
)
def test_every_option_reaches_nvrtc_through_cuda_core(spec):
    options, _ = jit_compiler.build_options(spec, lineinfo=True)
    options += [*jit_compiler._REPORT_RETRY_OPTIONS, "-DEXTRA=a=b"]
    passed = [o.decode() for o in jit_compiler.program_options(options, name="k.cu").as_bytes("nvrtc", "cubin")]
    expected = [_cuda_core_spelling(o) for o in options]
    assert sorted(passed) == sorted(expected)
    for prefix in ("--include-path=", "--ptxas-options=", "--pre-include=", "--define-macro="):  # in their order
        assert [o for o in passed if o.startswith(prefix)] == [o for o in expected if o.startswith(prefix)]


def test_an_option_cuda_core_cannot_pass_is_refused_by_name():
    with pytest.raises(ValueError, match="'-maxrregcount=64'"):
        jit_compiler.program_options(["--std=c++17", "-maxrregcount=64"], name="k.cu")
