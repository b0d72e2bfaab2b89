"""Markdown tables, provenance lines and PNG plots: the pieces every benchmark and experiment
report is written with (bench/ owns them so that bench never needs experiments/)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from routeformer.bench.timing import machine_description


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(command: str) -> str:
    import datetime

    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"Measured {now} on {machine_description()}. Command: `{command}`."


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def line_plot(
    path: Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, xlabel: str, ylabel: str,
    title: str, logx: bool = False, logy: bool = False,
) -> Path | None:
    """One PNG with a line per series; returns None (and writes nothing) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        axes.plot(list(xs), list(ys), marker="o", markersize=3, label=label)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logx:
        axes.set_xscale("log", base=2)
    if logy:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def scatter_plot(
    path: Path, points: dict[str, tuple[float, float]], highlighted: set[str], *, xlabel: str, ylabel: str,
    title: str, errors: dict[str, float] | None = None, reference: tuple[str, float] | None = None,
    samples: dict[str, list[float]] | None = None, limits: tuple[float, float] | None = None,
) -> Path | None:
    """One labelled point per name (x, y), `highlighted` ones filled and joined in x order (a Pareto
    front); `errors` adds vertical error bars (± that much, cut at `limits`, the metric's range),
    `samples` the per-seed values as small dots at the same x, `reference` a labelled horizontal
    line (a task's floor). Labels that would overlap another label or the reference line move
    up. Returns None (and writes nothing) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    xs = [x for x, _ in points.values()]
    ys = [y for _, y in points.values()] + [v for values in (samples or {}).values() for v in values]
    if reference is not None:
        ys.append(reference[1])
    x_span, y_span = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    if reference is not None:
        axes.axhline(reference[1], color="grey", linestyle=":", linewidth=1)
        axes.annotate(reference[0], (max(xs), reference[1]), fontsize=7, color="grey", ha="right",
                      xytext=(0, -9), textcoords="offset points")
    placed: list[tuple[float, float]] = []  # label anchors in data units
    for name, (x, y) in sorted(points.items(), key=lambda item: item[1][1]):
        on_front = name in highlighted
        if errors and errors.get(name):
            low, high = y - errors[name], y + errors[name]
            if limits is not None:
                low, high = max(low, limits[0]), min(high, limits[1])
            axes.errorbar([x], [y], yerr=[[y - low], [high - y]], color="C0", capsize=3, linewidth=1)
        for value in (samples or {}).get(name, []):
            axes.scatter([x], [value], s=8, color="C1", alpha=0.7, zorder=3)
        axes.scatter([x], [y], s=30, color="C0" if on_front else "none", edgecolors="C0", zorder=4)
        label_y = y
        while any(abs(x - px) < 0.12 * x_span and abs(label_y - py) < 0.05 * y_span for px, py in placed) or (
                reference is not None and abs(label_y - reference[1]) < 0.04 * y_span):
            label_y += 0.05 * y_span
        placed.append((x, label_y))
        axes.annotate(name, (x, label_y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted(points[name] for name in highlighted)
    if len(front) > 1:
        axes.plot([x for x, _ in front], [y for _, y in front], color="C0", alpha=0.5, linestyle="--")
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title + (" (dots: seeds)" if samples else ""))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
