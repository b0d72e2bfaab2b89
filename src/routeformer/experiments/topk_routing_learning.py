"""`routeformer reproduce topk-routing-learning`: how top-k's router should learn.

A hard top-K passes no gradient to the routing projections, so `routing_learning` picks the signal:
"distill" (KL to the attention over the routed set), "score_bias" (straight-through: the routing
score is added to the selected logits) or "none" (fixed random projections). Independently,
`routing_positions` is "recency" (a learned ALiBi-like slope in the routing score) or "none" (the
position-blind router). This experiment trains each routing_learning under the recency router,
distill under the position-blind one (one option changed at a time), and `full` as the reference,
on the two tasks of `routeformer compare --quick` with the same backbone, budget and
batches (per seed) as compare:

- MQAR, T=32, 4 pairs, vocabulary 16 (a setup `full` learns on every seed), K = T/8 = 4;
- the char LM on pydoc, T=128, K = T/8 = 16.

Every topk option is set explicitly (not left to the layer's default), so the experiment measures
the same thing whatever the default becomes. The default is chosen on the **validation** split (the
last evaluation of training); the report shows validation and **test** (measured once, after
training) side by side, mean ± sd over the seeds, with parameter counts (a frozen "none" router
holds no parameters) and each task's chance level and measured shortcut rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from routeformer.compare.budgets import QUICK
from routeformer.compare.report import task_floor
from routeformer.compare.stats import separated
from routeformer.experiments.registry import register_experiment
from routeformer.runner.jobs import Job, TaskSetup, cached_run, finished_records, run_jobs, say
from routeformer.runner.report import markdown_table, mean_sd, provenance, write_result
from routeformer.runner.seeds import seed_sweep
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule

LEARNING = ("distill", "score_bias", "none")
POSITIONS = ("recency", "none")
TASKS = ("mqar", "lm")
SEEDS = {"mqar": (0, 1, 2), "lm": (0, 1, 2)}


def variants(seq_len: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (mechanism, options): full; topk (K = T/8) with each routing_learning under the
    default recency router; and distill (the default before this experiment) with the position-blind
    router. Each topk row differs from another in one option. (The full 3 x 2 grid did not fit the
    time of a loaded 2-core machine.)"""
    grid: dict[str, tuple[str, dict[str, Any]]] = {"full": ("full", {})}
    pairs = [(learning, "recency") for learning in LEARNING] + [("distill", "none")]
    for learning, positions in pairs:
        grid[f"topk {learning}, positions={positions}"] = (
            "topk", {"topk": max(1, seq_len // 8), "routing_learning": learning,
                     "routing_positions": positions})
    return grid


def _quick_setup(setup: TaskSetup) -> TaskSetup:
    """A smoke-test budget: a few steps, small evaluation samples (checks plumbing, measures nothing)."""
    return TaskSetup({**setup.options, "seq_len": 32},
                     Schedule(steps=4, batch_size=8, lr=setup.schedule.lr, warmup_steps=1),
                     evals=1, validation_sequences=16, test_sequences=16)


def plan(quick: bool) -> tuple[dict[str, TaskSetup], dict[str, tuple[int, ...]], ModelSpec]:
    """Per task its setup (compare --quick's) and seeds; the backbone."""
    setups = {task: QUICK.tasks[task] for task in TASKS}
    if quick:
        return ({task: _quick_setup(setup) for task, setup in setups.items()}, {task: (0,) for task in TASKS},
                ModelSpec(dim=16, depth=1, heads=2, mlp_ratio=2.0, positions="rotary"))
    return setups, SEEDS, QUICK.spec


def jobs_for(setups: dict[str, TaskSetup], seeds: dict[str, tuple[int, ...]], spec: ModelSpec) -> list[Job]:
    """One job per (task, variant, seed); the key names all three."""
    runs = [(task, name) for task, setup in setups.items() for name in variants(setup.options["seq_len"])]
    jobs = []
    # seed-major: a run cut short holds whole seeds of every variant
    for (task, name), seed in seed_sweep(runs, lambda run: seeds[run[0]], seed_major=True):
        setup = setups[task]
        mechanism, options = variants(setup.options["seq_len"])[name]
        slug = name.replace(" ", "").replace(",", "-").replace("=", "")
        jobs.append(Job(f"{task}-{slug}-seed{seed}", task, dict(setup.options), mechanism, options,
                        seed, setup, spec))
    return jobs


def summarise(records: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Validation (last evaluation of training) and test of one variant over its seeds."""
    validation = [r["validation"][-1][metric] for r in records]
    test = [r["test"][metric] for r in records]
    return {"seeds": [r["seed"] for r in records], "parameters": records[0]["parameters"],
            "validation": validation, "test": test, "validation_mean_sd": mean_sd(validation),
            "test_mean_sd": mean_sd(test),
            "attention_flops_per_token": records[0]["test"]["attention_flops_per_token"],
            "routing_recall": [r["test"].get("routing_recall") for r in records]}


def choose(rows: dict[str, dict[str, Any]], higher: bool, vary: str, fixed: str) -> dict[str, Any]:
    """Among the topk rows with `fixed` in their name (one option held), the best validation mean
    when the other option varies, and which of the others it is separated from by > 3 sd."""
    candidates = {name: row for name, row in rows.items() if name.startswith("topk") and fixed in name}
    pick = (max if higher else min)(candidates, key=lambda n: candidates[n]["validation_mean_sd"][0])
    beats = [n for n in candidates if n != pick and len(candidates[n]["seeds"]) > 1 and separated(
        candidates[pick]["validation_mean_sd"], candidates[n]["validation_mean_sd"])]
    return {"varied": vary, "held": fixed, "best_on_validation": pick,
            "separated_from": beats, "not_separated_from": [n for n in candidates if n not in beats + [pick]]}


def _fmt(mean_and_sd: tuple[float, float]) -> str:
    return f"{mean_and_sd[0]:.3f} ± {mean_and_sd[1]:.3f}"


def task_section(task: str, setup: TaskSetup, rows: dict[str, dict[str, Any]], floor: dict[str, Any],
                 choices: list[dict[str, Any]], spec: ModelSpec) -> str:
    metric, schedule = floor["metric"], setup.schedule
    shortcuts = "; ".join(f"{name}: {value:.4f}" for name, value in floor["baselines"].items())
    table = markdown_table(
        ["variant", "params", "attention FLOPs/token", f"validation {metric}", "validation per seed",
         f"test {metric}", "test per seed", "test routing recall"],
        [[name, row["parameters"], f"{row['attention_flops_per_token']:.0f}", _fmt(row["validation_mean_sd"]),
          ", ".join(f"{v:.3f}" for v in row["validation"]), _fmt(row["test_mean_sd"]),
          ", ".join(f"{v:.3f}" for v in row["test"]),
          "-" if row["routing_recall"][0] is None else f"{mean_sd(row['routing_recall'])[0]:.3f}"]
         for name, row in rows.items()])
    picks = "\n".join(
        f"- {c['varied']} (held: `{c['held']}`): best on validation `{c['best_on_validation']}`; "
        f"separated (> 3 sd) from {c['separated_from'] or 'no other'}; not separated from "
        f"{c['not_separated_from'] or 'no other'}." for c in choices)
    return "\n\n".join([
        f"## {task}",
        f"Task `{floor['task']}`; {schedule.steps} steps of batch {schedule.batch_size}, lr {schedule.lr} "
        f"({schedule.warmup_steps} warm-up); validation on {setup.validation_sequences} sequences at the "
        f"last evaluation, test on {setup.test_sequences}. Backbone: {spec.depth} layers, D={spec.dim}, "
        f"{spec.heads} heads, MLP ratio {spec.mlp_ratio}, {spec.positions} positions. Floor: chance "
        f"{floor['chance']:.4f}; shortcut rules (test split): {shortcuts}.",
        table, "Choice on validation:\n" + picks])


@register_experiment("topk-routing-learning", "topk routing_learning (distill / score_bias / none) x "
                     "the position-blind router vs full, on compare-quick's MQAR and char LM, 3 seeds")
def routing_learning(out_dir: Path, quick: bool, workers: int = 1) -> Path:
    setups, seeds, spec = plan(quick)
    jobs = jobs_for(setups, seeds, spec)
    say(f"topk-routing-learning: {len(jobs)} runs, {workers} worker(s)")
    records = finished_records(run_jobs(out_dir, jobs, workers, say), "topk-routing-learning")
    result: dict[str, Any] = {"model": spec.__dict__, "seeds": {t: list(s) for t, s in seeds.items()},
                              "tasks": {}}
    sections = []
    for task, setup in setups.items():
        floor = cached_run(out_dir, f"{task}-floor",
                           lambda task=task, setup=setup: task_floor(task, setup.options))
        by_variant: dict[str, list[dict[str, Any]]] = {}
        for job in jobs:
            if job.task == task:
                name = next(n for n, (m, o) in variants(setup.options["seq_len"]).items()
                            if m == job.mechanism and o == job.options)
                by_variant.setdefault(name, []).append(records[job.key])
        rows = {name: summarise(recs, floor["metric"]) for name, recs in by_variant.items()}
        higher = floor["higher_is_better"]
        choices = [choose(rows, higher, "routing_learning", "positions=recency"),
                   choose(rows, higher, "routing_positions", "topk distill,")]
        result["tasks"][task] = {"setup": setup.as_dict(), "floor": floor, "variants": rows,
                                 "choices": choices}
        sections.append(task_section(task, setup, rows, floor, choices, spec))
    command = "routeformer reproduce topk-routing-learning" + (" --quick" if quick else "")
    markdown = "\n\n".join([
        "# topk-routing-learning: distill vs score_bias vs none, recency vs position-blind router",
        provenance(command),
        "Seeds: " + "; ".join(f"{task} {', '.join(map(str, s))}" for task, s in seeds.items())
        + " (mean ± sd); with one seed every variant sees the same "
        "batches. topk: K = T/8, routing dim 16, no forced keys; every option set explicitly. "
        "Separated = means differ by more than 3 times the larger sd.",
        *sections])
    return write_result(out_dir, result, markdown + "\n")
