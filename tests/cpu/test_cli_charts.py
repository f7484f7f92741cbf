"""The commands' charts (megamoe_rt/cli/plotting.py), drawn with matplotlib: the ``plot`` extra,
so these run where it is installed."""

from __future__ import annotations

import pytest

from megamoe_rt.cli import plotting

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _image(path) -> tuple[int, int]:
    """(height, width) of a PNG, read back by matplotlib."""
    from matplotlib import image

    data = path.read_bytes()
    assert data[:8] == PNG
    return image.imread(str(path)).shape[:2]


def test_the_tune_split_chart_has_a_bar_per_split(tmp_path):
    rows = [{"split_sms": [l1, 132 - l1, 132], "median_us": 100.0 + abs(l1 - 64)} for l1 in range(32, 120, 8)]
    path = tmp_path / "split.png"
    plotting.split_chart(rows, 4, 110.0, str(path), title="tune-split flash T=2048/rank x1 on NVIDIA H200")
    h, w = _image(path)
    assert h > 100 and w > 100


def test_the_prefill_chart_widens_with_its_rows(tmp_path):
    def rows(n: int) -> list[dict]:
        return [
            {"preset": "flash", "tokens": 16384, "mode": "fused", "ring": str(r), "time_vs_full": 1.0 + r / 100}
            for r in range(n)
        ]

    few, many = tmp_path / "few.png", tmp_path / "many.png"
    plotting.prefill_chart(rows(3), str(few))
    plotting.prefill_chart(rows(40), str(many))
    assert _image(many)[1] > _image(few)[1]


def test_the_sweep_chart_draws_every_node_and_the_whole_graph(tmp_path):
    rows = [
        {"value": v, "partitions": {"gemm": v}, "nodes_us": {"gemm": 1000 / v, "copy": 50.0 + v}, "total_us": 90.0}
        for v in (16, 32, 48)
    ]
    rows.append({"value": 64, "error": "did not fit"})  # a point that failed is left out
    path = tmp_path / "sweep.png"
    plotting.sweep_chart(rows, "gemm", str(path))
    assert _image(path)[0] > 100


def test_a_bar_chart_needs_a_bar(tmp_path):
    with pytest.raises(ValueError, match="at least one bar"):
        plotting.bar_chart(str(tmp_path / "x.png"), [], [], ylabel="us")


def test_matplotlib_is_found_where_it_is_installed():
    assert plotting.matplotlib_available()
    assert plotting.plotting_or_report("megamoe-rt sweep", "--plot")
