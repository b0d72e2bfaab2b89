"""The report of `routeformer compare`, one module for every budget: quality as mean ± sd over
seeds beside each task's chance level and measured shortcut baselines, executed FLOPs, time and
memory, and a quality-vs-cost Pareto plot with error bars.

one_stage.py  a one-stage task's section (`compare --quick`, `--full`): the table by mechanism,
              the pairs separated by more than 3 sd, quality against executed FLOPs
staged.py     a staged task's sections (`compare --long`): per evaluated length, Δ vs full, where
              routing pays, per position bucket and copy-predictable characters, validation at T
tables.py     the cells and table pieces both are written with (mean ± sd, Δ vs full, cost
              ratios, floor rows, per-bucket tables)
The statistics (separation, floors, paired Δ, Pareto front) are compare/stats.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from routeformer.bench.layers_bench import layer_bench_section
from routeformer.compare.budgets import budget_summary
from routeformer.compare.report.one_stage import one_stage_intro, one_stage_task, summarise_task
from routeformer.compare.report.staged import flat_records, staged_intro, staged_task_sections
from routeformer.runner.report import provenance, write_result

__all__ = ["earlier_invocations", "summarise_task", "task_floor", "write_compare_report"]


def task_floor(task: str, options: dict[str, Any], position_sequences: int = 0) -> dict[str, Any]:
    """Chance and measured shortcut baselines of `build_task(task, **options)`; with
    `position_sequences` > 0 and an LM task, also its n-gram floors per position bucket on the test
    sample of that many windows (`position_baselines`: the windows evaluate_on_task scores) and, for
    documents="start", the n-gram floors on its copy-predictable characters
    (`copy_predictable_baselines`)."""
    from routeformer.tasks import build_task

    built = build_task(task, **options)
    floor = {"task": built.describe(), "metric": built.metric, "higher_is_better": built.higher_is_better,
             "chance": built.chance, "baselines": built.baselines()}
    if position_sequences > 0 and hasattr(built, "position_baselines"):
        floor["position_baselines"] = built.position_baselines(position_sequences)
    if position_sequences > 0 and hasattr(built, "copy_predictable_baselines"):
        copy_floors = built.copy_predictable_baselines(position_sequences)
        if copy_floors:
            floor["copy_predictable_baselines"] = copy_floors
    return floor


def write_compare_report(
    out: Path, by_task: dict[str, dict[str, list[dict[str, Any]]]],
    floors: dict[str, dict[int, dict[str, Any]]], costs: dict[str, dict[str, Any]],
    bench_rows: list[dict[str, Any]], budget: Any, command: str, *,
    elapsed: float, workers: int, setups: dict[str, Any] | None = None,
    failed: dict[str, dict[str, str]] | None = None, bench_from_earlier: bool = False,
) -> Path:
    """report.md + result.json in `out`, from each task's runs by mechanism (`by_task`), floors by
    length (a one-stage setup's under 0), costs by mechanism and failed runs by label. A task's
    setup is `setups[task]`, else the budget's. A staged task (runner/setups.py) gets the sections
    of staged.py (per length, Δ vs full, where routing pays) and result.json its per-(length,
    mechanism, seed) `records`; a report with one opens as `compare --long`'s. A one-stage task gets
    one_stage.py's section and plot. A rerun keeps the wall-clock times of the invocations that
    wrote the report before (result.json `invocations`, named in report.md). Returns report.md's
    path."""
    given = setups or {}
    setups = {task: given[task] if task in given else budget.tasks[task] for task in by_task}
    failed = failed or {}
    staged = any(setup.staged for setup in setups.values())
    earlier = earlier_invocations(out / "result.json")
    invocations = [*earlier, {"command": command, "elapsed_seconds": elapsed}]
    failures = {f"{task}: {label}": error for task, labels in failed.items()
                for label, error in labels.items()}
    summary: dict[str, Any] = (
        {"command": command, "elapsed_seconds": elapsed, "tasks": {}, "failed": failures,
         "invocations": invocations} if staged else
        {"budget": budget_summary(budget), "elapsed_seconds": elapsed, "tasks": {},
         "invocations": invocations})
    sections = _opening(budget, command, elapsed, workers, earlier, staged)
    records = []
    for task, runs in by_task.items():
        setup = setups[task]
        if not runs:
            sections += [f"## {task}", "Every run failed: " + "; ".join(
                f"{name}: {error}" for name, error in failed.get(task, {}).items())]
            continue
        if setup.staged:
            task_sections, summary["tasks"][task] = staged_task_sections(out, task, setup, runs, costs[task],
                                                                         floors[task])
            sections += task_sections
            records += flat_records(task, runs, costs[task], floors[task])
        else:
            summary["tasks"][task] = one_stage_task(out, task, setup, runs, costs.get(task, {}),
                                                    floors[task][0], budget.seeds, sections)
        if failed.get(task):
            if not setup.staged:
                summary["tasks"][task]["failed"] = failed[task]
            sections.append("Failed runs (left out of the table; a re-run retries them): " + "; ".join(
                f"{name}: {error}" for name, error in failed[task].items()) + ".")
    if staged:
        summary["records"] = records
    if bench_rows:
        summary["bench"] = bench_rows
        sections += layer_bench_section(out, bench_rows)
        if bench_from_earlier:
            summary["bench_from_earlier_invocation"] = True
            sections.append("(Measured by an earlier invocation; this one ran with `--no-bench`.)")
    return write_result(out, summary, "\n\n".join(sections) + "\n")


def _opening(budget: Any, command: str, elapsed: float, workers: int, earlier: list[dict[str, Any]],
             staged: bool) -> list[str]:
    """The title, provenance and what the numbers mean (a report with a staged task: compare --long's)."""
    before = ("; earlier invocations that wrote this report: " + ", ".join(
        f"{run['elapsed_seconds']:.0f} s (`{run['command']}`)" for run in earlier) if earlier else "")
    if staged:
        return [
            "# routeformer compare --long: quality and cost where routing pays",
            provenance(command) + f" Wall-clock of this invocation: {elapsed:.0f} s ({elapsed / 60:.1f} min; "
            f"{workers} training processes, one thread each, then the cost measurements in one thread; runs "
            "finished by an earlier invocation are read, not re-run)" + before + ".",
            staged_intro(budget.spec, budget.repeats)]
    return [
        "# routeformer compare",
        provenance(command) + f" Wall-clock of this invocation: {elapsed:.0f} s ({workers} training "
        "process(es), one thread each; finished runs found on disk are not re-timed)" + before + ".",
        one_stage_intro(budget),
    ]


def earlier_invocations(result_json: Path) -> list[dict[str, Any]]:
    """The invocations (command, wall-clock) an existing result.json records; [] when none (no
    file, or one that is not JSON)."""
    try:
        previous = json.loads(result_json.read_text())
    except (OSError, ValueError):
        return []
    if "invocations" in previous:
        return list(previous["invocations"])
    if "elapsed_seconds" in previous:  # written before invocations were kept
        return [{"command": previous.get("command", "routeformer compare"),
                 "elapsed_seconds": previous["elapsed_seconds"]}]
    return []
