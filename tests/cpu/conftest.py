"""Fixtures shared by the CPU tests."""

from __future__ import annotations

import pytest

from tests.helpers.toy_kernel import write_toy_tree


@pytest.fixture()
def toy_kernel_tree(tmp_path, monkeypatch):
    """cuda_src/ replaced by a directory holding only toy.cu (tests.helpers.toy_kernel.TOY)."""
    return write_toy_tree(tmp_path / "src", monkeypatch)
