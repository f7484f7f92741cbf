"""NVRTC compilation, the cubin cache and resource reports (CPU only)."""

from __future__ import annotations

import os
import re
import stat

import pytest

from megamoe_rt.jit import CubinCache, KernelSpec, compile_kernel, parse_ptxas_report
from megamoe_rt.jit import compiler as jit_compiler
from megamoe_rt.jit.sass import (
    cubin_param_layout,
    descriptors_moved_from_vector_registers,
    dump_sass,
    find_cuobjdump,
    sass_digest,
    sass_opcodes,
    wgmma_issue_windows,
)
from megamoe_rt.kernels.loader import check_param_sizes
from megamoe_rt.kernels.registry import all_kernel_specs
from megamoe_rt.runtime.errors import NvrtcError

ALL_SPECS = all_kernel_specs()


@pytest.fixture()
def cache(tmp_path):
    return CubinCache(tmp_path / "cache")


@pytest.fixture()
def toy_tree(tmp_path, monkeypatch):
    """A private cuda_src tree with one templated kernel and a header it includes."""
    root = tmp_path / "src"
    (root / "ptx").mkdir(parents=True)
    (root / "ptx" / "value.cuh").write_text("#pragma once\nconstexpr int kValue = 7;\n")
    (root / "toy.cu").write_text(
        '#include "ptx/value.cuh"\n'
        "template <int N> __global__ void toy(int* out) { __shared__ int s[N]; s[threadIdx.x] = kValue;\n"
        "  __syncthreads(); out[threadIdx.x] = s[N - 1 - threadIdx.x]; }\n"
    )
    monkeypatch.setattr(jit_compiler, "cuda_src_dir", lambda: root)
    return root


TOY = KernelSpec(name="toy[64]", source="toy.cu", entry="toy<64>", block_threads=64)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_every_kernel_compiles_for_sm90a_without_spills(spec, cache):
    c = compile_kernel(spec, cache=cache)
    assert c.cubin[:4] == b"\x7fELF"
    r = c.resources
    assert r.name == spec.name
    assert 0 < r.registers <= 255
    assert r.spill_bytes == 0, f"{spec.name} spills: {r}"
    # A diagnostic printf needs a frame for its argument buffer and the non-inlined report it sits in.
    assert r.stack_frame_bytes == 0 or (spec.uses_printf and r.stack_frame_bytes <= 128), r
    assert r.static_smem_bytes + r.dynamic_smem_bytes <= 227 * 1024
    assert c.lowered_name.startswith("_Z")
    # ptxas C7518: it serialised the wgmmas (each waits for the one before), a silent slowdown.
    assert "C7518" not in c.log, f"{spec.name}: ptxas serialised its wgmmas:\n{c.log}"
    if spec.params and find_cuobjdump() is not None:
        # The host's declared arguments against the compiled kernel's, as the loader checks them
        # on a GPU: a parameter struct added, dropped or resized on one side only fails here.
        check_param_sizes(spec.name, spec.params, cubin_param_layout(c.cubin, c.lowered_name).get)


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump wheel not installed")
@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s.expect_sass], ids=lambda s: s.name)
def test_sass_contains_expected_instructions(spec, cache):
    c = compile_kernel(spec, cache=cache)
    sass = dump_sass(c.cubin)
    assert "sm_90a" in sass
    ops = sass_opcodes(sass)
    missing = [op for op in spec.expect_sass if op not in ops]
    assert not missing, f"{spec.name}: SASS lacks {missing}"
    assert "LDL" not in ops and "STL" not in ops  # nothing went to local memory
    if "QGMMA" in spec.expect_sass:
        # The k-block's wgmmas issue back to back: their shared-memory descriptors are computed
        # in uniform registers (ptx/warp_uniform.cuh), not moved there (R2UR) before each wgmma.
        windows = wgmma_issue_windows(sass)
        assert windows, f"{spec.name}: no wgmma issue sequence found"
        moved = [m for w in windows for m in descriptors_moved_from_vector_registers(w)]
        assert not moved, f"{spec.name}: wgmma descriptors moved from ordinary registers: {moved}"


def test_descriptor_moves_are_told_from_other_moves():
    window = [
        "WARPGROUP.ARRIVE",
        "R2UR UR20, R8",
        "R2UR UR6, R2",
        "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ, !UPT",
        "LDG.E.CONSTANT R1, desc[UR6][R4.64]",
        "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0",
    ]
    assert wgmma_issue_windows("".join(f"/*{i:04x}*/ {t} ;\n" for i, t in enumerate(window))) == [window]
    assert descriptors_moved_from_vector_registers(window) == ["R2UR UR20, R8"]
    # A uniform register filled by R2UR for a load and written again before a QGMMA reads it.
    reused = [
        "WARPGROUP.ARRIVE",
        "R2UR UR12, R2",
        "LDG.E.CONSTANT R14, desc[UR12][R14.64]",
        "UIADD3.64 UR12, UR8, 0x4, URZ",
        "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0",
    ]
    assert descriptors_moved_from_vector_registers(reused) == []


def test_cache_hit_returns_identical_cubin(toy_tree, cache):
    first = compile_kernel(TOY, cache=cache)
    second = compile_kernel(TOY, cache=cache)
    assert not first.from_cache and second.from_cache
    assert first.cubin == second.cubin
    assert first.resources == second.resources
    assert first.lowered_name == second.lowered_name == "_Z3toyILi64EEvPi"
    assert first.resources.static_smem_bytes == 64 * 4


def test_cache_dir_is_private(toy_tree, tmp_path):
    d = tmp_path / "fresh" / "cache"
    compile_kernel(TOY, cache=CubinCache(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_cache_key_follows_included_header(toy_tree, cache):
    a = compile_kernel(TOY, cache=cache)
    (toy_tree / "ptx" / "value.cuh").write_text("#pragma once\nconstexpr int kValue = 8;\n")
    b = compile_kernel(TOY, cache=cache)
    assert a.cache_key != b.cache_key and not b.from_cache
    assert a.cubin != b.cubin


def test_cache_key_follows_pre_included_header(toy_tree, cache):
    """A spec's pre-included header (a GEMM epilogue policy) and what it includes key the cubin."""
    (toy_tree / "ptx" / "policy.cuh").write_text(
        '#pragma once\n#include "ptx/value.cuh"\nstruct Policy { static __device__ int v() { return kValue; } };\n'
    )
    (toy_tree / "policy_toy.cu").write_text("template <class P> __global__ void ptoy(int* out) { out[0] = P::v(); }\n")
    spec = KernelSpec(name="ptoy", source="policy_toy.cu", entry="ptoy<Policy>", includes=("ptx/policy.cuh",))
    a = compile_kernel(spec, cache=cache)
    assert compile_kernel(spec, cache=cache).from_cache
    (toy_tree / "ptx" / "value.cuh").write_text("#pragma once\nconstexpr int kValue = 8;\n")
    b = compile_kernel(spec, cache=cache)
    assert a.cache_key != b.cache_key and not b.from_cache
    assert a.cubin != b.cubin
    with pytest.raises(FileNotFoundError, match="pre-included header 'ptx/none.cuh'"):
        compile_kernel(
            KernelSpec(name="x", source="policy_toy.cu", entry="ptoy<Policy>", includes=("ptx/none.cuh",)), cache=cache
        )


def test_cache_key_follows_options_and_entry(toy_tree, cache):
    base = compile_kernel(TOY, cache=cache)
    with_lines = compile_kernel(TOY, cache=cache, lineinfo=True)
    other_n = compile_kernel(KernelSpec(name="toy[32]", source="toy.cu", entry="toy<32>"), cache=cache)
    defined = compile_kernel(
        KernelSpec(name="toy[64]d", source="toy.cu", entry="toy<64>", defines=(("UNUSED_FLAG", "1"),)), cache=cache
    )
    keys = {base.cache_key, with_lines.cache_key, other_n.cache_key, defined.cache_key}
    assert len(keys) == 4


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "garbage", "empty"])
def test_damaged_entry_is_rebuilt_not_loaded(toy_tree, cache, damage):
    good = compile_kernel(TOY, cache=cache)
    path = cache.path_for(good.cache_key)
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) - 17]
    elif damage == "flip_payload":
        blob[-40] ^= 0x5A
    elif damage == "flip_header":
        i = blob.index(b'"lowered_name"')
        blob[i + 20] ^= 0x01
    elif damage == "garbage":
        blob = bytearray(os.urandom(len(blob)))
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))
    assert cache.load(good.cache_key) is None and not path.exists()
    again = compile_kernel(TOY, cache=cache)
    assert not again.from_cache and again.cubin == good.cubin
    assert compile_kernel(TOY, cache=cache).from_cache


def test_writes_leave_no_temporary_files(toy_tree, cache):
    compile_kernel(TOY, cache=cache)
    names = sorted(os.listdir(cache.directory))
    entry = [n for n in names if n.endswith(".cubin")]
    assert len(entry) == 1 and not entry[0].startswith(".tmp")
    assert names == sorted([entry[0], ".lock-" + entry[0][: -len(".cubin")]])  # the entry and its (empty) build lock


def test_compile_error_raises_with_log(toy_tree, cache):
    (toy_tree / "broken.cu").write_text("__global__ void broken(int* p) { p[0] = undefined_name; }\n")
    with pytest.raises(NvrtcError) as info:
        compile_kernel(KernelSpec(name="broken", source="broken.cu", entry="broken"), cache=cache)
    assert "undefined_name" in info.value.log
    assert "nvrtcCompileProgram" in str(info.value)
    assert cache.entries() == []


def test_the_compile_log_is_nvrtcs_own_whatever_the_error_text_says(toy_tree, cache, monkeypatch):
    from megamoe_rt.jit import compiler

    monkeypatch.setattr(compiler, "_nvrtc_failure", lambda exc: ("NVRTC_ERROR_COMPILATION", ""))  # reworded
    (toy_tree / "broken.cu").write_text("__global__ void broken(int* p) { p[0] = undefined_name; }\n")
    with pytest.raises(NvrtcError) as info:
        compile_kernel(KernelSpec(name="broken", source="broken.cu", entry="broken"), cache=cache)
    assert "undefined_name" in info.value.log and "nvrtcCompileProgram" in str(info.value)


def test_missing_project_header_is_reported(toy_tree, cache):
    (toy_tree / "lost.cu").write_text('#include "nowhere/missing.cuh"\n__global__ void lost() {}\n')
    with pytest.raises(FileNotFoundError, match="missing.cuh"):
        compile_kernel(KernelSpec(name="lost", source="lost.cu", entry="lost"), cache=cache)


SAMPLE_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1aPi' for 'sm_90a'
ptxas info    : Function properties for _Z1aPi
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z1bPi' for 'sm_90a'
ptxas info    : Function properties for _Z1bPi
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, 384 bytes cmem[0]
"""


def test_ptxas_report_parser():
    a = parse_ptxas_report(SAMPLE_LOG, "_Z1aPi", name="a", dynamic_smem_bytes=4096)
    assert (a.registers, a.stack_frame_bytes, a.spill_store_bytes, a.spill_load_bytes) == (168, 24, 8, 12)
    assert (a.static_smem_bytes, a.dynamic_smem_bytes, a.smem_bytes, a.barriers) == (1024, 4096, 5120, 1)
    assert a.spill_bytes == 20
    b = parse_ptxas_report(SAMPLE_LOG, "_Z1bPi", name="b")
    assert (b.registers, b.spill_bytes, b.static_smem_bytes, b.barriers) == (40, 0, 0, 0)
    with pytest.raises(ValueError, match="_Z1cPi"):
        parse_ptxas_report(SAMPLE_LOG, "_Z1cPi", name="c")


def test_report_survives_nvrtc_in_process_cubin_cache(toy_tree, cache, monkeypatch):
    """NVRTC 13.0 skips ptxas (and its -v report) for PTX it already built in this
    process; the resources must still come out right."""
    real = jit_compiler._nvrtc_compile
    calls = []

    def without_report(spec, options):
        cubin, lowered, log = real(spec, options)
        calls.append(list(options))
        if jit_compiler._REPORT_RETRY_OPTIONS[0] not in options:
            log = ""  # what a cache hit inside NVRTC looks like
        return cubin, lowered, log

    monkeypatch.setattr(jit_compiler, "_nvrtc_compile", without_report)
    monkeypatch.setattr(jit_compiler, "_reports", {})
    reference = real(TOY, jit_compiler.build_options(TOY, lineinfo=False)[0])
    expected = parse_ptxas_report(reference[2], reference[1], name=TOY.name)
    first = compile_kernel(TOY, cache=cache, use_cache=False)
    assert len(calls) == 2 and jit_compiler._REPORT_RETRY_OPTIONS[0] in calls[1]
    second = compile_kernel(TOY, cache=cache, use_cache=False)
    assert len(calls) == 3  # served from the remembered report, no retry
    assert first.resources == second.resources == expected


def _nvrtc_reporting_only_with(option, *, other_entries=False):
    """An NVRTC whose cache hides the report of every run without ``option``; with
    ``other_entries`` such a run still reports an unrelated entry."""
    real = jit_compiler._nvrtc_compile
    calls = []

    def compile_(spec, options):
        cubin, lowered, log = real(spec, options)
        calls.append(list(options))
        if option is None or option not in options:
            log = OTHER_ENTRY_LOG if other_entries else ""
        return cubin, lowered, log

    return compile_, calls


OTHER_ENTRY_LOG = (
    "ptxas info    : Compiling entry function '_Z5otherPi' for 'sm_90a'\n"
    "ptxas info    : Used 8 registers, used 0 barriers, 352 bytes cmem[0]\n"
)


def test_a_log_reporting_other_entries_only_is_retried(toy_tree, cache, monkeypatch):
    compile_, calls = _nvrtc_reporting_only_with(jit_compiler._REPORT_RETRY_OPTIONS[0], other_entries=True)
    monkeypatch.setattr(jit_compiler, "_nvrtc_compile", compile_)
    monkeypatch.setattr(jit_compiler, "_reports", {})
    got = compile_kernel(TOY, cache=cache, use_cache=False).resources
    assert len(calls) == 2 and got.registers > 0 and got.name == TOY.name


def test_a_retry_that_hits_the_cache_too_tries_the_second_neutral_option(toy_tree, cache, monkeypatch):
    real = jit_compiler._nvrtc_compile
    reference = real(TOY, jit_compiler.build_options(TOY, lineinfo=False)[0])
    compile_, calls = _nvrtc_reporting_only_with(jit_compiler._REPORT_RETRY_OPTIONS[1])
    monkeypatch.setattr(jit_compiler, "_nvrtc_compile", compile_)
    monkeypatch.setattr(jit_compiler, "_reports", {})
    got = compile_kernel(TOY, cache=cache, use_cache=False).resources
    assert [c[-1] for c in calls[1:]] == list(jit_compiler._REPORT_RETRY_OPTIONS)
    assert got == parse_ptxas_report(reference[2], reference[1], name=TOY.name)


def test_no_report_after_every_retry_names_the_kernel_and_shows_the_log(toy_tree, cache, monkeypatch):
    compile_, calls = _nvrtc_reporting_only_with(None, other_entries=True)
    monkeypatch.setattr(jit_compiler, "_nvrtc_compile", compile_)
    monkeypatch.setattr(jit_compiler, "_reports", {})
    with pytest.raises(RuntimeError, match=rf"kernel {re.escape(TOY.name)}: ptxas gave no resource report") as err:
        compile_kernel(TOY, cache=cache, use_cache=False)
    assert "_Z5otherPi" in str(err.value) and len(calls) == 1 + len(jit_compiler._REPORT_RETRY_OPTIONS)


def test_reports_for_kernels_sharing_one_source(toy_tree, cache, monkeypatch):
    """Three kernels of one file share its PTX: NVRTC's in-process cache reports ptxas once
    per (PTX, options), so the second and third compiles see no report, and the retry
    with the neutral option reports only once too. Every kernel still gets its own
    resources."""
    (toy_tree / "many.cu").write_text(
        "__global__ void k_one(int* o) { o[threadIdx.x] = 1; }\n"
        "__global__ void k_two(int* o) { __shared__ int s[32]; s[threadIdx.x] = o[0];\n"
        "  __syncthreads(); o[threadIdx.x] = s[31 - threadIdx.x]; }\n"
        "__global__ void k_three(int* o, int n) { for (int i = 0; i < n; ++i) o[i] += i; }\n"
    )
    specs = [KernelSpec(name=n, source="many.cu", entry=n, block_threads=32) for n in ("k_one", "k_two", "k_three")]
    real = jit_compiler._nvrtc_compile
    reference = {s.entry: real(s, jit_compiler.build_options(s, lineinfo=False)[0]) for s in specs}
    seen_ptxas_runs = set()

    def nvrtc_with_cubin_cache(spec, options):
        cubin, lowered, log = real(spec, options)
        key = tuple(options)  # one source: the same PTX for every entry
        if key in seen_ptxas_runs:
            log = ""
        seen_ptxas_runs.add(key)
        return cubin, lowered, log

    monkeypatch.setattr(jit_compiler, "_nvrtc_compile", nvrtc_with_cubin_cache)
    monkeypatch.setattr(jit_compiler, "_reports", {})
    for s in specs:
        got = compile_kernel(s, cache=cache, use_cache=False).resources
        _, lowered, log = reference[s.entry]
        assert got == parse_ptxas_report(log, lowered, name=s.name)
    assert compile_kernel(specs[1], cache=cache, use_cache=False).resources.static_smem_bytes == 128


def test_the_sass_digest_sees_instructions_not_encodings_or_addresses_of_the_listing():
    listing = (
        "        code for sm_90a\n"
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;            /* 0x00000a00ff017b82 */\n"
        "        /*0010*/              @!P0 BRA 0x40 ;                        /* 0x000000000000b947 */\n"
    )
    same = listing.replace("0x00000a00ff017b82", "0x1111111111111111").replace("code for sm_90a", "code")
    assert sass_digest(listing) == sass_digest(same)
    assert sass_digest(listing) != sass_digest(listing.replace("@!P0", "@P0"))  # a predicate is code
    assert sass_digest(listing) != sass_digest(listing.replace("BRA 0x40", "BRA 0x50"))


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump wheel not installed")
def test_the_sass_digest_is_a_builds_and_tells_kernels_apart(tmp_path):
    one = compile_kernel(ALL_SPECS[0], cache=CubinCache(tmp_path / "a"))
    again = compile_kernel(ALL_SPECS[0], cache=CubinCache(tmp_path / "b"))
    other = compile_kernel(ALL_SPECS[1], cache=CubinCache(tmp_path / "a"))
    assert not again.from_cache
    assert sass_digest(dump_sass(one.cubin)) == sass_digest(dump_sass(again.cubin))
    assert sass_digest(dump_sass(one.cubin)) != sass_digest(dump_sass(other.cubin))


@pytest.mark.skipif(find_cuobjdump() is None, reason="cuobjdump wheel not installed")
def test_the_cubins_parameter_records_catch_a_declaration_the_kernel_does_not_have(cache):
    import ctypes

    from megamoe_rt.kernels.loader import KernelParamMismatch

    spec = next(s for s in ALL_SPECS if s.name == "quantize_fp8_1x128[bf16]")
    c = compile_kernel(spec, cache=cache)
    layout = cubin_param_layout(c.cubin, c.lowered_name)
    assert sorted(layout) == list(range(len(spec.params)))
    assert [size for _, size in (layout[i] for i in sorted(layout))] == [ctypes.sizeof(t) for t in spec.params]
    for declared in (spec.params + (ctypes.c_uint64,), spec.params[:-1] + (ctypes.c_uint32 * 3,)):
        with pytest.raises(KernelParamMismatch):
            check_param_sizes(spec.name, declared, layout.get)
