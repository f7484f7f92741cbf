"""Markers `gpu` and `multigpu` skip cleanly where no Hopper GPU (or too few) is present.

The multi-GPU tests run at MEGAMOE_RT_TEST_RANKS ranks (default 2; bench/ep8.sh sets 4 or 8).
With MEGAMOE_RT_RANK_DEVICES set (e.g. ``0``: every rank on GPU 0) they need only the GPUs it
names: ranks sharing a GPU run the same cross-rank paths, time-sharing it."""

from __future__ import annotations

import functools
import os

import pytest

TEST_RANKS = int(os.environ.get("MEGAMOE_RT_TEST_RANKS", "2"))


@functools.cache
def hopper_gpu_count() -> int:
    from megamoe_rt.runtime import devices

    try:
        return sum(1 for d in devices.list_devices() if d.is_hopper)
    except Exception:
        return 0


def multigpu_need() -> int:
    """GPUs the multi-GPU tests need: one per rank, or those MEGAMOE_RT_RANK_DEVICES names."""
    from megamoe_rt.ep.env import assigned_device

    world = max(2, TEST_RANKS)
    if os.environ.get("MEGAMOE_RT_RANK_DEVICES", "").strip():
        return 1 + max(assigned_device(r) or 0 for r in range(world))
    return world


def pytest_collection_modifyitems(config, items):
    n = None
    multigpu = multigpu_need()
    for item in items:
        need = multigpu if "multigpu" in item.keywords else 1 if "gpu" in item.keywords else 0
        if not need:
            continue
        if n is None:
            n = hopper_gpu_count()
        if n < need:
            reason = "needs a Hopper (sm_90) GPU" if need == 1 else f"needs {need} Hopper GPUs"
            item.add_marker(pytest.mark.skip(reason=f"{reason}; found {n}"))


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Tests compile into their own cache unless the caller pinned one."""
    if "MEGAMOE_RT_CACHE" not in os.environ:
        os.environ["MEGAMOE_RT_CACHE"] = str(tmp_path_factory.mktemp("megamoe_rt_cache"))
    yield


@pytest.fixture()
def toy_kernel_tree(tmp_path, monkeypatch):
    """cuda_src/ replaced by a directory holding only toy.cu (tests.helpers.toy_kernel.TOY)."""
    from tests.helpers.toy_kernel import write_toy_tree

    return write_toy_tree(tmp_path / "src", monkeypatch)


@pytest.fixture(scope="session")
def base_install_python(tmp_path_factory) -> str:
    """A Python that sees only what ``pip install megamoe-rt`` installs, no extra
    (tests/helpers/base_install.py)."""
    from tests.helpers.base_install import make_base_install

    return make_base_install(tmp_path_factory.mktemp("base_install"))
