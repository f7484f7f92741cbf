"""A one-file kernel tree for tests of the JIT and its cache, compiled in place of cuda_src/."""

from __future__ import annotations

from megamoe_rt.jit import KernelSpec
from megamoe_rt.jit import compiler as jit_compiler

TOY = KernelSpec(name="toy[3]", source="toy.cu", entry="toy<3>", block_threads=32)


def write_toy_tree(root, monkeypatch):
    """cuda_src/ replaced by ``root`` holding only toy.cu (TOY's source)."""
    root.mkdir()
    (root / "toy.cu").write_text("template <int N> __global__ void toy(int* out) { out[threadIdx.x] = N; }\n")
    monkeypatch.setattr(jit_compiler, "cuda_src_dir", lambda: root)
    return root
