"""Writing experiment outputs: result JSON, Markdown tables, per-run records, PNG plots."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from routeformer.bench.timing import machine_description
from routeformer.train.task_loop import resumable_training, training_checkpoints


def cached_run(out_dir: Path, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Return the stored record of run `key`, or compute and store it (atomically): a killed
    experiment picks up after its last finished run, and within the unfinished run after the last
    evaluation of its `train_task` calls (`train.task_loop.resumable_training`); those checkpoints
    are deleted once the record is stored."""
    runs = out_dir / "runs"
    path = runs / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    with resumable_training(runs, key):
        record = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)
    for checkpoint in training_checkpoints(runs, key):
        checkpoint.unlink()
    return record


def write_result(out_dir: Path, result: dict[str, Any], markdown: str) -> Path:
    """result.json and report.md, each replaced atomically (an interrupt leaves the old or the new)."""
    from routeformer.train.progress import write_text_atomic

    write_text_atomic(out_dir / "result.json", json.dumps(result, indent=1))
    report = out_dir / "report.md"
    write_text_atomic(report, markdown)
    return report


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


def _pyplot():
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
    plt = _pyplot()
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
) -> Path | None:
    """One labelled point per name (x, y), `highlighted` ones filled and joined in x order (a Pareto
    front); `errors` adds vertical error bars (± that much), `reference` a labelled horizontal line
    (a task's floor). Returns None (and writes nothing) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    if reference is not None:
        axes.axhline(reference[1], color="grey", linestyle=":", linewidth=1)
        axes.annotate(reference[0], (min(x for x, _ in points.values()), reference[1]), fontsize=7,
                      color="grey", xytext=(0, 3), textcoords="offset points")
    for name, (x, y) in points.items():
        on_front = name in highlighted
        if errors and errors.get(name):
            axes.errorbar([x], [y], yerr=[errors[name]], color="C0", capsize=3, linewidth=1)
        axes.scatter([x], [y], s=30, color="C0" if on_front else "none", edgecolors="C0")
        axes.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted(points[name] for name in highlighted)
    if len(front) > 1:
        axes.plot([x for x, _ in front], [y for _, y in front], color="C0", alpha=0.5, linestyle="--")
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
