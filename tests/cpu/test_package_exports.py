"""The names ``megamoe_rt`` exports, and that importing it stays cheap and CPU-safe."""

from __future__ import annotations

import subprocess
import sys

import megamoe_rt


def test_streaming_and_entry_point_names_come_from_the_package():
    from megamoe_rt.requirements import require_gpu
    from megamoe_rt.routers import Router
    from megamoe_rt.schedule.streaming import StreamConfig
    from megamoe_rt.streaming import ChunkWriter

    assert megamoe_rt.StreamConfig is StreamConfig and megamoe_rt.ChunkWriter is ChunkWriter
    assert megamoe_rt.Router is Router and megamoe_rt.require_gpu is require_gpu
    names = {"StreamConfig", "ChunkWriter", "Router", "require_gpu"}
    assert names <= set(megamoe_rt.__all__) and names <= set(dir(megamoe_rt))


def test_importing_the_package_loads_no_gpu_library_and_no_layer():
    # The exports load on first use: `import megamoe_rt` must not pull CuPy, the CUDA bindings
    # or the layer's modules (a CPU-only machine, and startup time).
    probe = (
        "import sys, megamoe_rt; "
        "print(' '.join(m for m in ('cupy', 'cuda.core', 'cuda.bindings', 'megamoe_rt.streaming', "
        "'megamoe_rt.routers', 'megamoe_rt.layer', 'megamoe_rt.requirements') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr
