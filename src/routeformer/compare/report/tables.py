"""The cells and table pieces both kinds of compare section are written with: mean ± sd, paired
Δ vs full (with the 3 sd mark), cost ratios and optional costs, a floor's shortcut rules, floor
rows under a table, and the per-bucket tables (position buckets, copy-predictable contexts) with
each mechanism's values beside its paired Δ vs full."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routeformer.attention import baseline_name
from routeformer.compare.stats import delta_separated, paired_differences
from routeformer.runner.report import mean_sd

NO_DELTA = "—"  # the baseline's own Δ cell, or one with no seed paired with the baseline
NO_VALUE = "-"  # a cost that was not measured


def mean_sd_cell(mean: float, sd: float, digits: int = 4) -> str:
    """`mean ± sd` with `digits` decimals."""
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def values_cell(values: Sequence[float], digits: int = 3) -> str:
    """`mean ± sd` (runner.report.mean_sd) of `values` with `digits` decimals; NO_DELTA when empty."""
    if not values:
        return NO_DELTA
    return mean_sd_cell(*mean_sd(list(values)), digits)


def delta_cell(mean: float, sd: float, marked: bool, digits: int = 3) -> str:
    """A signed `±mean ± sd` with `digits` decimals, ` *` appended where `marked` (beyond 3 sd)."""
    return f"{mean:+.{digits}f} ± {sd:.{digits}f}" + (" *" if marked else "")


def deltas_cell(deltas: Sequence[float], digits: int = 3) -> str:
    """The Δ cell of per-seed paired differences: their mean ± sd, marked beyond 3 sd
    (`stats.delta_separated`); NO_DELTA when there are none."""
    if not deltas:
        return NO_DELTA
    mean, sd = mean_sd(list(deltas))
    return delta_cell(mean, sd, delta_separated(mean, sd, len(deltas)), digits)


def yes_no(flag: bool) -> str:
    """"yes" or "no"."""
    return "yes" if flag else "no"


def ratio_cell(value: float | None, spec: str = ".2f") -> str:
    """A ratio (a cost / full's) formatted with `spec`; NO_VALUE for None (no full to divide by)."""
    return NO_VALUE if value is None else format(value, spec)


def optional_cell(value: Any, spec: str | None = None) -> Any:
    """NO_VALUE for None; else `value` formatted with `spec`, or `value` itself without one (for
    markdown_table to format)."""
    if value is None:
        return NO_VALUE
    return value if spec is None else format(value, spec)


def shortcut_rules(floor: Mapping[str, Any]) -> str:
    """The floor's shortcut baselines as `name: value; ...` (4 decimals)."""
    return "; ".join(f"{name}: {value:.4f}" for name, value in floor["baselines"].items())


def floor_rows(floors: Mapping[str, Mapping[str, float]], columns: Sequence[str], *,
               blank_after: bool = False) -> list[list[str]]:
    """One `floor: NAME` row per floor (name -> column -> value, 3 decimals) under a per-bucket
    table; with `blank_after`, an empty cell after each value (the Δ column beside it)."""
    rows = []
    for name, by_column in floors.items():
        cells = [f"{by_column[column]:.3f}" for column in columns]
        if blank_after:
            cells = [cell for value in cells for cell in (value, "")]
        rows.append([f"floor: {name}", *cells])
    return rows


def bucket_cells(per_seed: Mapping[str, Sequence[Mapping[str, float]]], seeds: Mapping[str, Sequence[Any]],
                 columns: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """Per mechanism and column (a position bucket, a copy-predictable context): the value cell
    (mean ± sd over seeds, 3 decimals) and the Δ vs full cell (the mean ± sd of the per-seed
    differences from full on the same seed, * beyond 3 sd; NO_DELTA for full itself, without
    full, or with no seed shared). `per_seed`: mechanism -> one {column: value} per seed, in the
    order of `seeds[mechanism]`."""
    baseline = baseline_name()
    full = dict(zip(seeds.get(baseline, ()), per_seed.get(baseline, ()), strict=True))
    cells = {}
    for mechanism, values in per_seed.items():
        mine = list(zip(seeds[mechanism], values, strict=True))
        row = []
        for column in columns:
            value = values_cell([v[column] for v in values])
            if mechanism == baseline:
                row.append((value, NO_DELTA))
                continue
            deltas = paired_differences([(seed, v[column]) for seed, v in mine],
                                        {seed: v[column] for seed, v in full.items()})
            row.append((value, deltas_cell(deltas)))
        cells[mechanism] = row
    return cells
