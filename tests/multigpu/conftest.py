"""The multi-GPU tests run at MEGAMOE_RT_TEST_RANKS ranks (default 2; bench/ep8.sh sets 4 or 8)
and skip cleanly on a machine with fewer Hopper GPUs."""

from __future__ import annotations

import os

import pytest

WORLD = int(os.environ.get("MEGAMOE_RT_TEST_RANKS", "2"))


@pytest.fixture(autouse=True)
def _enough_gpus(request):
    from tests.conftest import hopper_gpu_count

    if request.node.get_closest_marker("multigpu") and hopper_gpu_count() < WORLD:
        pytest.skip(f"MEGAMOE_RT_TEST_RANKS={WORLD} needs {WORLD} Hopper GPUs")
