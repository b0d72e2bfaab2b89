"""The report of `routeformer compare`: quality as mean ± sd over seeds beside each task's chance
level and measured shortcut baselines, which mechanism pairs are separated by more than 3 sd,
executed FLOPs, time and memory, and the quality-vs-FLOPs Pareto plot with error bars."""

from __future__ import annotations

import json
import statistics
from itertools import combinations
from pathlib import Path
from typing import Any

from routeformer.attention import attention_class, baseline_name
from routeformer.bench.layers_bench import layer_bench_section
from routeformer.compare.budgets import budget_summary
from routeformer.compare.stats import SEPARATION_SDS, pareto_front, separated
from routeformer.runner.report import markdown_table, mean_sd, provenance, scatter_plot, write_result


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


def summarise_task(task: str, runs: dict[str, list[dict[str, Any]]], costs: dict[str, dict[str, Any]],
                   floor: dict[str, Any]) -> dict[str, Any]:
    """Per mechanism: quality mean ± sd, seeds, parameters, FLOPs, costs; plus separated pairs."""
    higher = floor["higher_is_better"]
    rows = {}
    for mechanism, records in runs.items():
        quality = mean_sd([r["quality"] for r in records])
        rows[mechanism] = {
            "mechanism": mechanism, "quality_mean": quality[0], "quality_sd": quality[1],
            "qualities": [r["quality"] for r in records], "seeds": [r["seed"] for r in records],
            "parameters": records[0]["parameters"],
            "flops_per_token": statistics.fmean(r["attention_flops_per_token"] for r in records),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in records),
            **costs.get(mechanism, {})}
    full_flops = rows.get(baseline_name(), {}).get("flops_per_token")
    best_floor = (max if higher else min)([floor["chance"], *floor["baselines"].values()])
    for row in rows.values():
        row["flops_vs_full"] = row["flops_per_token"] / full_flops if full_flops else None
        row["above_floor"] = len(row["qualities"]) > 1 and separated(
            (row["quality_mean"], row["quality_sd"]), (best_floor, 0.0)) and (
            row["quality_mean"] > best_floor if higher else row["quality_mean"] < best_floor)
    pairs = [[a, b] for a, b in combinations(rows, 2)
             if min(len(rows[a]["qualities"]), len(rows[b]["qualities"])) > 1
             and separated((rows[a]["quality_mean"], rows[a]["quality_sd"]),
                           (rows[b]["quality_mean"], rows[b]["quality_sd"]))]
    points = {m: (r["flops_per_token"], r["quality_mean"]) for m, r in rows.items()}
    front = pareto_front(points, higher)
    for mechanism, row in rows.items():
        row["pareto"] = mechanism in front
    return {"floor": floor, "best_floor": best_floor, "rows": list(rows.values()), "separated_pairs": pairs}


def write_compare_report(
    out: Path, by_task: dict[str, dict[str, list[dict[str, Any]]]],
    floors: dict[str, dict[int, dict[str, Any]]], costs: dict[str, dict[str, Any]],
    bench_rows: list[dict[str, Any]], budget: Any, command: str, *,
    elapsed: float, workers: int, setups: dict[str, Any] | None = None,
    failed: dict[str, dict[str, str]] | None = None, bench_from_earlier: bool = False,
) -> Path:
    """report.md + result.json in `out`, from each task's runs by mechanism (`by_task`), floors by
    length (a one-stage setup's under 0), costs by mechanism and failed runs by label. A staged
    task (runner/setups.py) gets the sections of compare/staged_report.py (per length, Δ vs full,
    where routing pays) and result.json its per-(length, mechanism, seed) `records`; a report with
    one opens as `compare --long`'s. A rerun keeps the wall-clock times of the invocations that
    wrote the report before (result.json `invocations`, named in report.md)."""
    from routeformer.compare.staged_report import flat_records, staged_task_sections

    setups = {task: (setups or {}).get(task, budget.tasks[task]) for task in by_task}
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
            summary["tasks"][task] = _plain_task(out, task, setup, runs, costs.get(task, {}), floors[task][0],
                                                 budget.seeds, sections)
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
    spec = budget.spec
    if staged:
        from routeformer.compare.staged_report import staged_intro

        return [
            "# routeformer compare --long: quality and cost where routing pays",
            provenance(command) + f" Wall-clock of this invocation: {elapsed:.0f} s ({elapsed / 60:.1f} min; "
            f"{workers} training processes, one thread each, then the cost measurements in one thread; runs "
            "finished by an earlier invocation are read, not re-run)" + before + ".",
            staged_intro(spec, budget.repeats)]
    return [
        "# routeformer compare",
        provenance(command) + f" Wall-clock of this invocation: {elapsed:.0f} s ({workers} training "
        "process(es), one thread each; finished runs found on disk are not re-timed)" + before + ".",
        f"Budget `{budget.name}`: one backbone for every mechanism ({spec.depth} layers, D={spec.dim}, "
        f"{spec.heads} heads, MLP ratio {spec.mlp_ratio}, {spec.positions} positions), AdamW with warm-up "
        f"and cosine decay; {budget.seeds} seeds per mechanism, and with the same seed every mechanism sees "
        "the same batches. Quality: the task's metric on its test split, mean ± sd over the seeds (the "
        "setups were chosen on the validation split). Local windows T/4, top-k T/8 keys, MiTA T/8 landmarks "
        "of T/8 keys (causal: blocks of T/8), Meta-Attention's local expert T/4. FLOPs: attention FLOPs the "
        "layers executed, per "
        f"token. Step/inference ms: medians of {budget.repeats} repetitions on one training batch, one "
        "thread as in training (fresh model); peak MiB: extra memory of one training step. ★: Pareto "
        "front of quality "
        f"against executed FLOPs. A difference counts as real only beyond {SEPARATION_SDS:g} sd (the larger "
        "of the two).",
    ]


def _plain_task(out: Path, task: str, setup: Any, runs: dict[str, list[dict[str, Any]]],
                costs: dict[str, Any], floor: dict[str, Any], seeds: int, sections: list[str],
                ) -> dict[str, Any]:
    """A one-stage task's summary; appends its sections and writes `pareto_{task}.png`."""
    task_summary = summarise_task(task, runs, costs, floor)
    sections += _task_section(task, setup, task_summary, runs)
    rows = task_summary["rows"]
    scatter_plot(out / f"pareto_{task}.png",
                 {r["mechanism"]: (r["flops_per_token"], r["quality_mean"]) for r in rows},
                 {r["mechanism"] for r in rows if r["pareto"]},
                 xlabel="attention FLOPs per token (executed)", ylabel=floor["metric"],
                 title=f"{task}: quality (mean ± sd, {seeds} seeds) vs executed FLOPs",
                 errors={r["mechanism"]: r["quality_sd"] for r in rows},
                 reference=("best floor", task_summary["best_floor"]))
    return task_summary


def earlier_invocations(result_json: Path) -> list[dict[str, Any]]:
    """The invocations (command, wall-clock) an existing result.json records; [] when none."""
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


def _task_section(task: str, setup: Any, summary: dict[str, Any], runs: dict[str, list]) -> list[str]:
    floor, rows, schedule = summary["floor"], summary["rows"], setup.schedule
    metric = floor["metric"]
    table = [[("★ " if r["pareto"] else "") + r["mechanism"], r["parameters"],
              f"{r['quality_mean']:.4f} ± {r['quality_sd']:.4f}", "yes" if r["above_floor"] else "no",
              r["flops_per_token"], "-" if r["flops_vs_full"] is None else r["flops_vs_full"],
              r.get("train_step_ms", "-"), r.get("inference_ms", "-"),
              "-" if r.get("train_step_peak_mib") is None else r["train_step_peak_mib"],
              round(r["train_seconds"], 1)] for r in rows]
    baselines = "; ".join(f"{name}: {value:.4f}" for name, value in floor["baselines"].items())
    chance_word = "uniform guess (bits/char)" if metric != "accuracy" else "best input-blind guess"
    pairs = summary["separated_pairs"]
    lines = [
        f"## {task}",
        f"Task `{floor['task']}`; {schedule.steps} steps of batch {schedule.batch_size}, lr {schedule.lr:g} "
        f"({schedule.warmup_steps} warm-up); test on {setup.test_sequences} sequences. "
        f"Floor: {chance_word} {floor['chance']:.4f}; shortcut rules (measured on the test split): "
        f"{baselines}.",
        markdown_table(["mechanism", "params", f"{metric} (mean ± sd)", "beats floor by > 3 sd",
                        "FLOPs/token",
                        "FLOPs / full's", "train step ms", "inference ms", "peak MiB", "train s"], table),
        ("Pairs separated by more than 3 sd: " + ", ".join(f"{a} / {b}" for a, b in pairs) + "."
         if pairs else "No pair of mechanisms is separated by more than 3 sd at this budget."),
        f"Plot: `pareto_{task}.png`.",
    ]
    injected = [mechanism for mechanism in runs if attention_class(mechanism).needs_meta_tokens]
    if injected:
        lines.append(", ".join(f"`{name}`" for name in injected) + " trains on windows with `_PAUSE_` "
                     "injected at density 0.1, so it reads 10% fewer characters per window than the others "
                     "(no loss on meta-tokens).")
    return lines
