"""``python -m megamoe_rt.cli.bench gemm|moe|overhead|prefill|stream ...``: the benchmark commands as a
module, so that ``megamoe-rt launch -n N -m megamoe_rt.cli.bench moe|overhead|prefill|stream ...`` runs
the layer benchmarks across the launched ranks; outside a launch it is ``megamoe-rt bench ...``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """``python -m megamoe_rt.cli.bench gemm|moe|overhead|prefill|stream ...``; started by ``megamoe-rt launch
    -n N -m megamoe_rt.cli.bench moe|overhead|prefill|stream ...`` the layer benchmarks run across the
    launched ranks."""
    from megamoe_rt.ep.launch import launched

    argv = list(sys.argv[1:] if argv is None else argv)
    if launched() and argv[:1] in (["moe"], ["overhead"], ["prefill"], ["stream"]):
        from megamoe_rt.cli.bench_ep import main_ep

        return main_ep(argv[1:], what=argv[0])
    from megamoe_rt.cli.main import main as cli_main

    return cli_main(["bench", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
