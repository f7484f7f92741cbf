"""A layer call that is meant to trap, run in a fresh process (a trap ends the CUDA context)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def trap_script(t, h, i, e, k, timeout_s, setup, hook, *, mode="fused"):
    """A call of a ``mode`` layer in a fresh process, with ``setup`` run between load_weights and
    the call and the call made inside ``with <hook>:`` (a megamoe_rt.testing context manager);
    exits 3 printing the CudaError when a kernel traps, prints "finished" otherwise."""
    head = textwrap.dedent(f"""
        import sys
        import numpy as np
        import cupy as cp
        from megamoe_rt import MegaMoE, reference as ref
        from megamoe_rt import testing
        from megamoe_rt.runtime import driver
        from cuda.bindings import driver as cu
        rng = np.random.default_rng(0)
        inp = ref.random_moe_inputs(rng, {t}, {h}, {i}, {e}, {k})
        layer = MegaMoE({h}, {i}, {e}, {k}, {t}, mode="{mode}", timeout_s={timeout_s})
        layer.load_weights(inp["w1"], inp["w1_sf"], inp["w2"], inp["w2_sf"])
    """)
    tail = textwrap.dedent(f"""
        args = [cp.asarray(inp[n].view(np.uint8) if n == "x" else inp[n]) for n in ("x", "x_sf", "topk_idx", "topk_weights")]
        with {hook}:
            layer(*args)
    """)
    return head + textwrap.dedent(setup) + tail + SYNC_AND_REPORT


# The end of every trap script: wait for the device; a trap exits 3 printing the CudaError
# (which carries the deadline report), a clean finish prints "finished".
SYNC_AND_REPORT = textwrap.dedent("""
    try:
        driver.call(cu.cuCtxSynchronize)
    except driver.CudaError as err:
        print("ERROR", err)
        sys.exit(3)
    print("finished")
""")


WITHHOLD_HOOK = "testing.withhold_block(layer, int(sys.argv[1]))"


def check_withheld(script: str, block: int, finishes: bool, wait_name: str) -> None:
    """Run ``script`` withholding ``block``: it finishes, or it traps naming ``wait_name``."""
    out = subprocess.run([sys.executable, "-c", script, str(block)], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    if finishes:
        assert out.returncode == 0 and "finished" in out.stdout, text
    else:
        assert out.returncode == 3, text
        assert f"wait '{wait_name}' timed out" in text and "expected >= " in text, text
