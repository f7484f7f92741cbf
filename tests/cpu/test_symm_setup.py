"""A symmetric buffer whose setup fails on some rank is freed on every rank, and every rank
raises the same error (CPU: NVSHMEM and the device stand-ins record what happens)."""

from __future__ import annotations

from megamoe_rt.ep.launch import spawn
from tests.helpers import ranks


def test_a_half_built_symmetric_buffer_is_freed_collectively():
    out = spawn(ranks.half_built_symmetric_buffer, 2)
    texts = {text for text, _, _ in out}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert "setup failed on rank 0" in text and "freed on every rank" in text
    assert "rank 0: RuntimeError: no device memory to zero here" in text
    assert "rank 1: RuntimeError: ranks [0] are not reachable by load/store" in text
    for _, freed, registered in out:
        assert freed == [0x10000] and registered == []
