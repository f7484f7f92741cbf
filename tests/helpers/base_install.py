"""An interpreter that sees what ``pip install megamoe-rt`` installs, and nothing of an extra.

The test environment has the cu13 extra; a user's fresh ``pip install .`` has only the base
dependencies. Rather than install a second environment from the network, a bare virtual
environment (no pip) gets one path entry holding links to this environment's installed copies
of exactly those distributions (megamoe-rt's own requirements without an extra marker, and
theirs), so CuPy, cuda-core, NVSHMEM and the NVIDIA library wheels are absent the way they
are after ``pip install .``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import venv
from pathlib import Path

from packaging.requirements import Requirement

import megamoe_rt


def _base_distributions() -> list[md.Distribution]:
    """megamoe-rt's requirements without an extra, and their requirements, as installed here."""
    todo = ["megamoe-rt"]
    seen: dict[str, md.Distribution] = {}
    while todo:
        name = todo.pop()
        dist = md.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    seen.pop("megamoe-rt")  # linked from the imported package below (an editable install has no files)
    return list(seen.values())


def _entries(dist: md.Distribution) -> set[Path]:
    """The paths of ``dist`` directly under its site directory, one level deeper inside a
    namespace package (``cuda/bindings``, never all of ``cuda``: cuda-core lives there too)."""
    out = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if not parts or parts[0] == "..":  # scripts outside the site directory
            continue
        top = Path(parts[0])
        where = Path(str(dist.locate_file(top)))
        namespace = where.is_dir() and not (where / "__init__.py").exists() and not top.suffix
        out.add(Path(*parts[:2]) if namespace and len(parts) > 2 else top)
    return out


def make_base_install(root: Path) -> str:
    """A bare virtual environment under ``root`` seeing only the base install; its Python."""
    links = root / "site"
    for dist in _base_distributions():
        for rel in _entries(dist):
            target = Path(str(dist.locate_file(rel)))
            link = links / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(target)
    (links / "megamoe_rt").symlink_to(Path(megamoe_rt.__file__).resolve().parent)
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "megamoe_rt_base_install.pth").write_text(f"{links}\n")
    return str(python)


def base_env() -> dict[str, str]:
    """The environment to run it in: nothing pointing back at this one's packages or a CUDA root."""
    drop = {"PYTHONPATH", "PYTHONHOME", "CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_base(python: str, argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=base_env(), check=False
    )


if __name__ == "__main__":  # a look at one: python -m tests.helpers.base_install DIR
    print(make_base_install(Path(sys.argv[1])))
