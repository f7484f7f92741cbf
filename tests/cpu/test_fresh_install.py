"""What `pip install ".[cu13]"` gives a fresh Hopper machine: every shared library the demo and
the examples load is found the way CuPy and cuda-bindings find it, and comes from a wheel of the
extra, not from whatever CUDA toolkit the machine happens to have.

No GPU is needed: loading a library (dlopen) does not touch the device. The lookups run in a
fresh process, so nothing this test process loaded earlier can stand in for them.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

# cuda.pathfinder's names of the libraries on the demo's path: NVRTC compiles the kernels,
# nvJitLink links those using NVSHMEM's device library, cudart and cuRAND are CuPy's
# (cupy.random draws the demo's and the examples' inputs), libnvshmem_host is NVSHMEM's host side.
DEMO_LIBRARIES = ("nvrtc", "nvJitLink", "cudart", "curand", "nvshmem_host")

_LOOKUP = """
import json, sys
from cuda import pathfinder
found = {}
for name in sys.argv[1:]:
    try:
        lib = pathfinder.load_nvidia_dynamic_lib(name)
    except Exception as exc:
        found[name] = {"error": str(exc).splitlines()[0]}
    else:
        found[name] = {"path": lib.abs_path, "via": lib.found_via}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict[str, str]]:
    out = subprocess.run([sys.executable, "-c", _LOOKUP, *DEMO_LIBRARIES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _extras_distributions() -> set[str]:
    """The distributions megamoe-rt's cu13 and cu12 extras require (normalised names)."""
    names = set()
    for text in md.requires("megamoe-rt") or []:
        req = Requirement(text)
        if req.marker is not None and any(req.marker.evaluate({"extra": e}) for e in ("cu13", "cu12")):
            names.add(req.name.lower().replace("_", "-"))
    return names


def _owner(path: str) -> str | None:
    """The installed distribution whose files include ``path``."""
    target = Path(path).resolve()
    for dist in md.distributions():
        for f in dist.files or ():
            if f.name == target.name and Path(str(dist.locate_file(f))).resolve() == target:
                return dist.metadata["Name"].lower().replace("_", "-")
    return None


@pytest.mark.parametrize("name", DEMO_LIBRARIES)
def test_each_library_of_the_demo_loads_from_a_wheel_of_the_extra(name, loaded):
    lib = loaded[name]
    assert "error" not in lib, f"{name}: {lib.get('error')}"
    assert Path(lib["path"]).is_file(), lib
    assert lib["via"] == "site-packages", f"{name} came from {lib['via']} ({lib['path']}), not from a wheel"
    owner = _owner(lib["path"])
    assert owner in _extras_distributions(), f"{name}: {lib['path']} belongs to {owner}, not to a wheel of the extras"


def test_cupy_loads_curand_itself():
    # CuPy looks cuRAND up through cuda.pathfinder when cupy.random first needs it; without the
    # wheel this import is the ImportError a fresh machine met at the demo's first random draw.
    out = subprocess.run(
        [sys.executable, "-c", "import cupy_backends.cuda.libs as libs; print(libs.curand.__name__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "curand" in out.stdout, out.stderr


def test_the_entry_points_check_finds_the_whole_stack():
    from megamoe_rt.requirements import missing, stack_problem

    assert missing() == [] and stack_problem() is None
