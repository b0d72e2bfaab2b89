"""A one-stage task's part of the report (`compare --quick`, `--full`): per mechanism quality
(mean ± sd over seeds) beside the task's chance level and shortcut rules, executed FLOPs and the
measured costs, the pairs separated by more than 3 sd, and the quality-vs-FLOPs Pareto plot."""

from __future__ import annotations

import statistics
from itertools import combinations
from pathlib import Path
from typing import Any

from routeformer.attention import attention_class, baseline_name
from routeformer.compare.report.tables import mean_sd_cell, optional_cell, ratio_cell, shortcut_rules, yes_no
from routeformer.compare.stats import SEPARATION_SDS, beats_floor, best_floor, pareto_front, separated
from routeformer.runner.report import markdown_table, mean_sd, scatter_plot


def one_stage_intro(budget: Any) -> str:
    """What a one-stage budget's numbers mean (the report's opening paragraph)."""
    spec = budget.spec
    return (
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
        "of the two).")


def summarise_task(task: str, runs: dict[str, list[dict[str, Any]]], costs: dict[str, dict[str, Any]],
                   floor: dict[str, Any]) -> dict[str, Any]:
    """A one-stage task's result.json summary from its runs by mechanism (each record: seed,
    quality, parameters, attention_flops_per_token, train_seconds), its costs by mechanism and its
    floor (`task_floor`): per mechanism quality mean ± sd, seeds, parameters, FLOPs (and their ratio
    to full's), costs, whether it beats the best floor, whether it is on the Pareto front; plus the
    best floor and the pairs separated by more than 3 sd (both with at least two seeds)."""
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
    best = best_floor(floor)
    for row in rows.values():
        row["flops_vs_full"] = row["flops_per_token"] / full_flops if full_flops else None
        row["above_floor"] = beats_floor(row["qualities"], best, higher)
    pairs = [[a, b] for a, b in combinations(rows, 2)
             if min(len(rows[a]["qualities"]), len(rows[b]["qualities"])) > 1
             and separated((rows[a]["quality_mean"], rows[a]["quality_sd"]),
                           (rows[b]["quality_mean"], rows[b]["quality_sd"]))]
    points = {m: (r["flops_per_token"], r["quality_mean"]) for m, r in rows.items()}
    front = pareto_front(points, higher)
    for mechanism, row in rows.items():
        row["pareto"] = mechanism in front
    return {"floor": floor, "best_floor": best, "rows": list(rows.values()), "separated_pairs": pairs}


def one_stage_task(out: Path, task: str, setup: Any, runs: dict[str, list[dict[str, Any]]],
                   costs: dict[str, Any], floor: dict[str, Any], seeds: int, sections: list[str],
                   ) -> dict[str, Any]:
    """A one-stage task's summary (`summarise_task`); appends its sections to `sections` and writes
    `pareto_{task}.png` (quality, mean ± sd over `seeds` seeds, against executed FLOPs)."""
    task_summary = summarise_task(task, runs, costs, floor)
    sections += task_sections(task, setup, task_summary, runs)
    rows = task_summary["rows"]
    scatter_plot(out / f"pareto_{task}.png",
                 {r["mechanism"]: (r["flops_per_token"], r["quality_mean"]) for r in rows},
                 {r["mechanism"] for r in rows if r["pareto"]},
                 xlabel="attention FLOPs per token (executed)", ylabel=floor["metric"],
                 title=f"{task}: quality (mean ± sd, {seeds} seeds) vs executed FLOPs",
                 errors={r["mechanism"]: r["quality_sd"] for r in rows},
                 reference=("best floor", task_summary["best_floor"]))
    return task_summary


def task_sections(task: str, setup: Any, summary: dict[str, Any], runs: dict[str, list]) -> list[str]:
    """The section of a one-stage task from its summary (`summarise_task`): the setup and floor,
    the table by mechanism (★: Pareto front), the separated pairs, the plot's name, and a note on
    mechanisms trained on windows with injected meta-tokens."""
    floor, rows, schedule = summary["floor"], summary["rows"], setup.schedule
    metric = floor["metric"]
    table = [[("★ " if r["pareto"] else "") + r["mechanism"], r["parameters"],
              mean_sd_cell(r["quality_mean"], r["quality_sd"]), yes_no(r["above_floor"]),
              r["flops_per_token"], ratio_cell(r["flops_vs_full"], ".4g"),
              r.get("train_step_ms", "-"), r.get("inference_ms", "-"),
              optional_cell(r.get("train_step_peak_mib")),
              round(r["train_seconds"], 1)] for r in rows]
    chance_word = "uniform guess (bits/char)" if metric != "accuracy" else "best input-blind guess"
    pairs = summary["separated_pairs"]
    lines = [
        f"## {task}",
        f"Task `{floor['task']}`; {schedule.steps} steps of batch {schedule.batch_size}, lr {schedule.lr:g} "
        f"({schedule.warmup_steps} warm-up); test on {setup.test_sequences} sequences. "
        f"Floor: {chance_word} {floor['chance']:.4f}; shortcut rules (measured on the test split): "
        f"{shortcut_rules(floor)}.",
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
