"""The oldest toolkit wheels each extra of pyproject.toml allows, as pip requirements.

For each extra (cu13, cu12): the lowest version on the package index that satisfies the
extra's specifier, for the packages that decide how kernels compile (NVRTC, the CCCL headers),
for cuda-core, whose Program passes NVRTC megamoe_rt's options, for cuda-bindings, which
loads NVRTC, and for nvJitLink, which ``megamoe-rt compile`` asks for before any build
(megamoe_rt.requirements.COMPILER). Usage: ``python oldest_nvrtc.py EXTRA``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement
from packaging.version import Version

COMPILE_PACKAGES = ("nvidia-cuda-nvrtc", "nvidia-cuda-cccl", "cuda-core", "cuda-bindings", "nvidia-nvjitlink")


def available_versions(name: str) -> list[Version]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"Available versions: (.*)", out)
    if not match:
        raise SystemExit(f"no versions of {name} on the index")
    return [Version(v.strip()) for v in match.group(1).split(",")]


def oldest(extra: str) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    pins = []
    for text in project["optional-dependencies"][extra]:
        req = Requirement(text)
        if not req.name.startswith(COMPILE_PACKAGES):
            continue
        allowed = [v for v in available_versions(req.name) if v in req.specifier and not v.is_prerelease]
        if not allowed:
            raise SystemExit(f"{text}: no version on the index satisfies it")
        pins.append(f"{req.name}=={min(allowed)}")
    return pins


if __name__ == "__main__":
    print(json.dumps(oldest(sys.argv[1])))
