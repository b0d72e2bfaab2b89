"""The experiments' report module: result.json and report.md, mean ± sd over seeds (one convention),
and the Markdown tables, provenance lines and plots (written by bench.tables_and_plots, re-exported
here so that an experiment imports its report pieces from one place)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from routeformer.bench.tables_and_plots import line_plot, markdown_table, provenance, scatter_plot

__all__ = ["format_mean_sd", "line_plot", "markdown_table", "mean_sd", "provenance", "scatter_plot",
           "write_result"]


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value). Every mean ± sd an
    experiment reports comes from here, so every report uses the same sd."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def format_mean_sd(values: list[float], digits: int = 3) -> str:
    """`mean ± sd` with `digits` decimals; a single value says so instead of showing an sd of 0."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (1 seed)"
    mean, sd = mean_sd(values)
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def write_result(out_dir: Path, result: dict[str, Any], markdown: str) -> Path:
    """result.json and report.md, each replaced atomically (an interrupt leaves the old or the new)."""
    from routeformer.train.progress import write_text_atomic

    write_text_atomic(out_dir / "result.json", json.dumps(result, indent=1))
    report = out_dir / "report.md"
    write_text_atomic(report, markdown)
    return report
