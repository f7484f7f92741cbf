"""Markdown table of an A/B run (bench/ab_run.sh): the baseline tree's arms and this tree's, cell by cell.

    python bench/ab_table.py OUTDIR        reads OUTDIR/{base,tree,base2}.json (base2 if present)

Reads the JSON of `megamoe-rt bench gemm` (rows with "shape" and "arms") or of `bench moe` (rows
with "preset", "tokens", "mode"). Prints one row per cell: each arm's median in us, this tree's
TFLOP/s, the ratio tree / mean of the base runs (below 1 is faster), the drift between the two base
runs, and for bench gemm the torch grouped peer's TFLOP/s and this tree's speed against it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _gemm_key(row: dict[str, Any]) -> tuple[Any, ...]:
    s = row["shape"]
    return (s["preset"], s["stage"], s["tokens"], row["config"])


def _moe_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["preset"], row["mode"], row["tokens"])


def _median_us(row: dict[str, Any]) -> float | None:
    if "arms" in row:
        arm = row["arms"]["megamoe_rt"]
        return None if arm.get("error") else arm["median_us"]
    return row.get("median_us")


def _tflops(row: dict[str, Any]) -> float | None:
    if "arms" in row:
        return row["arms"]["megamoe_rt"].get("tflops")
    return row.get("tflops")


def _peer_tflops(row: dict[str, Any]) -> float | None:
    peer = row.get("arms", {}).get("torch._scaled_grouped_mm")
    return None if peer is None or peer.get("error") else peer.get("tflops")


def _load(path: Path) -> dict[tuple[Any, ...], dict[str, Any]]:
    rows = json.loads(path.read_text())
    key = _gemm_key if rows and "shape" in rows[0] else _moe_key
    # The base tree's heuristic may pick another config for the same shape, so cells match by
    # shape alone, unless the run swept configs (--tiles: several rows per shape).
    shapes = [key(r)[:3] for r in rows]
    width = 4 if len(set(shapes)) < len(shapes) else 3
    return {key(r)[:width]: r for r in rows}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(outdir: Path) -> str:
    base = _load(outdir / "base.json")
    tree = _load(outdir / "tree.json")
    base2_path = outdir / "base2.json"
    base2 = _load(base2_path) if base2_path.exists() else {}
    lines = [
        "| cell | base us | tree us | base2 us | tree / base | base drift | tree TFLOP/s | peer TFLOP/s | tree / peer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, t in tree.items():
        b, b2 = base.get(key), base2.get(key)
        tb, bb = _median_us(t), _median_us(b) if b else None
        bb2 = _median_us(b2) if b2 else None
        bases = [v for v in (bb, bb2) if v is not None]
        ratio = tb / (sum(bases) / len(bases)) if tb is not None and bases else None
        drift = bb2 / bb if bb is not None and bb2 is not None else None
        tf, peer = _tflops(t), _peer_tflops(t)
        vs_peer = tf / peer if tf is not None and peer else None
        lines.append(
            f"| {' '.join(str(k) for k in key)} | {_fmt(bb, '.1f')} | {_fmt(tb, '.1f')} | {_fmt(bb2, '.1f')} | "
            f"{_fmt(ratio, '.3f')} | {_fmt(drift, '.3f')} | {_fmt(tf, '.0f')} | {_fmt(peer, '.0f')} | {_fmt(vs_peer, '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print(table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
