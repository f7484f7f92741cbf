"""The commands' charts, drawn with matplotlib (the ``plot`` extra).

matplotlib is imported only when a chart is drawn; a command given a chart option asks
:func:`plotting_or_report` first, before any GPU work, so a missing matplotlib ends it with
one line naming the install command (exit status 1, as for the other extras), not after the
measurement. Figures are made without pyplot (``matplotlib.figure.Figure``): no backend or
global figure state is touched.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

PLOT_INSTALL = 'pip install "megamoe-rt[plot]"'


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def plotting_or_report(program: str, option: str) -> bool:
    """Whether ``option``'s chart can be drawn; False after one line on stderr saying what is
    missing and how to install it (under ``megamoe-rt launch``, left to the launcher)."""
    if matplotlib_available():
        return True
    from megamoe_rt.requirements import report

    report(program, f"{option} draws with matplotlib, which is not installed; install: {PLOT_INSTALL}")
    return False


def _figure(width: float, height: float = 4.0) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bar_chart(
    path: str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    ylabel: str,
    xlabel: str = "",
    title: str = "",
    highlight: int | None = None,
    reference: float | None = None,
    reference_label: str = "",
) -> None:
    """One bar per value, left to right, the ``highlight`` one in another colour; a dashed line
    at ``reference``. Written to ``path`` (PNG, or the format its suffix names)."""
    if not values:
        raise ValueError("values: expected at least one bar")
    fig, ax = _figure(max(5.0, 1.0 + 0.35 * len(values)))
    colours = ["tab:orange" if n == highlight else "tab:blue" for n in range(len(values))]
    ax.bar(range(len(values)), values, color=colours)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=90 if max(map(len, labels), default=0) > 6 else 0, fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="tab:red", linestyle="--", linewidth=1, label=reference_label or None)
        if reference_label:
            ax.legend()
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path)


def line_chart(
    path: str,
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    emphasis: str | None = None,
) -> None:
    """A line with markers per series against ``xs``; the ``emphasis`` series drawn bolder."""
    fig, ax = _figure(7.0)
    for name, ys in series.items():
        bold = name == emphasis
        ax.plot(xs, ys, marker="s" if bold else "o", linewidth=2 if bold else 1, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, path)


def sweep_chart(rows: list[dict], vary: str | None, path: str) -> None:
    """``megamoe-rt sweep --plot``: each node alone and the whole graph against the varied partition."""
    ok = [r for r in rows if "error" not in r]
    series: dict[str, list[float]] = {
        f"{n} alone": [r["nodes_us"][n] for r in ok] for n in (ok[0]["nodes_us"] if ok else {})
    }
    series["whole graph"] = [r["total_us"] for r in ok]
    line_chart(
        path,
        [r["value"] for r in ok],
        series,
        xlabel=f"SMs in partition {vary}",
        ylabel="device time (us)",
        emphasis="whole graph",
    )


def split_chart(
    rows: list[dict], best: int, fused_us: float, path: str, *, title: str = "", reference_label: str = ""
) -> None:
    """``megamoe-rt tune-split --png``: a bar per K1/K2 split (``rows``: the split rows), the
    fastest highlighted, a line at the fused mode's time (``reference_label``: that mode's name,
    by default the registry's default among the fused kernel's modes)."""
    from megamoe_rt.modes.registry import FUSED_KERNEL, default_mode

    bar_chart(
        path,
        [f"{r['split_sms'][0]}|{r['split_sms'][1]}" for r in rows],
        [r["median_us"] for r in rows],
        ylabel="device time (us)",
        xlabel="K1 | K2 SMs",
        title=title,
        highlight=best,
        reference=fused_us,
        reference_label=reference_label or default_mode(FUSED_KERNEL),
    )


def prefill_chart(rows: list[dict], path: str) -> None:
    """``megamoe-rt bench prefill --png``: a bar per row, its time against the same mode's full
    pool; the line marks +5%."""
    bar_chart(
        path,
        [f"{r['preset']} {r['tokens']} {r['mode']} {r['ring']}" for r in rows],
        [r["time_vs_full"] for r in rows],
        ylabel="time / full pool's",
        title="bench prefill: rings against the full pool",
        reference=1.05,
        reference_label="+5%",
    )
