"""NVSHMEM's device API in an NVRTC kernel: compiled relocatable, linked with NVSHMEM's device
archive by nvJitLink, cached like every other kernel (no GPU needed)."""

from __future__ import annotations

import pytest

from megamoe_rt.jit import CubinCache, compile_kernel
from megamoe_rt.jit import compiler as jit_compiler
from megamoe_rt.jit.link import LinkError, link_cubin, nvjitlink_version
from megamoe_rt.jit.paths import device_library_path
from megamoe_rt.kernels.probe import NVSHMEM_LINK_SPEC, device_link_specs


@pytest.fixture(autouse=True)
def _toolchain():
    try:
        nvjitlink_version()
    except LinkError as exc:
        pytest.skip(str(exc).splitlines()[0])
    if device_library_path("nvshmem") is None:
        pytest.skip("NVSHMEM's device library is not installed")


def test_an_nvshmem_kernel_links_into_a_loadable_cubin_and_is_cached(tmp_path):
    cache = CubinCache(tmp_path / "cache")
    built = compile_kernel(NVSHMEM_LINK_SPEC, cache=cache)
    assert not built.from_cache and built.cubin[:4] == b"\x7fELF"
    assert built.lowered_name.encode() in built.cubin
    assert "--relocatable-device-code=true" in built.options
    assert built.resources.spill_bytes == 0 and built.resources.registers > 0
    again = compile_kernel(NVSHMEM_LINK_SPEC, cache=cache)
    assert again.from_cache and again.cubin == built.cubin and again.cache_key == built.cache_key
    assert device_link_specs() == [NVSHMEM_LINK_SPEC]


def test_the_cache_key_names_the_nvshmem_and_nvjitlink_versions():
    options, external = jit_compiler.build_options(NVSHMEM_LINK_SPEC, lineinfo=False)
    _, material = jit_compiler.cache_key(NVSHMEM_LINK_SPEC, options, external)
    assert material["external_headers"]["nvshmem"].startswith("nvidia-nvshmem-cu1")
    assert material["device_libraries"] == ["nvshmem"]
    assert material["nvjitlink"] == list(nvjitlink_version())
    from importlib import metadata

    assert material["cuda_core"] == metadata.version("cuda-core")  # its option spelling is part of the build


def test_without_the_library_every_nvshmem_call_is_an_undefined_reference():
    options, _ = jit_compiler.build_options(NVSHMEM_LINK_SPEC, lineinfo=False)
    relocatable, _, _ = jit_compiler._nvrtc_compile(NVSHMEM_LINK_SPEC, options)
    with pytest.raises(LinkError, match="while linking probe") as info:
        link_cubin(relocatable, [], arch=jit_compiler.ARCH, name="probe")
    assert "Undefined reference" in info.value.log and "nvshmem" in info.value.log


def test_the_ep_kernels_nvshmem_transport_links_without_spills(tmp_path):
    from megamoe_rt.kernels import ep

    specs = ep.device_link_specs()
    assert {s.name for s in specs} == {
        "ep_publish[nvshmem]",
        "ep_recv_layout[nvshmem]",
        "ep_dispatch[nvshmem]",
        "ep_finish[nvshmem]",
        "ep_push[nvshmem]",
    }
    cache = CubinCache(tmp_path / "cache")
    for spec in specs:
        built = compile_kernel(spec, cache=cache)
        assert built.lowered_name.encode() in built.cubin, spec.name
        assert built.resources.spill_bytes == 0 and built.resources.registers > 0, (spec.name, built.resources)
    # The peer-pointer variants stay among the kernels built with every other one, and link nothing.
    assert all(not s.device_libraries for s in ep.kernel_specs())
    assert not any(s.name.endswith("[nvshmem]") for s in ep.kernel_specs())
