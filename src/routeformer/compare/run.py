"""`routeformer compare`: mechanisms trained on the same `routeformer.tasks` tasks, seeds and budget.

Per task (`TaskSetup`) every mechanism gets the same backbone (`ModelSpec`), the same optimiser
schedule and, per seed, the same batches (the batch stream depends on the seed only); only the
attention layers differ. Quality is the task's metric on its test split, reported as mean ± sd
over the seeds beside the task's chance level and the measured accuracy of its shortcut rules.

The budgets (QUICK, FULL) and the options each mechanism gets are in compare/budgets.py.

Runs are independent jobs (task, mechanism, seed): they run in `workers` processes with one
thread each (tiny models use one core better than two), each stored as JSON when it finishes, so a
killed compare resumes after its finished runs (and inside a run, after its last evaluation). Step
time, inference time and peak memory are measured afterwards in this process, one mechanism after
another on an idle machine, on a freshly initialised model.
"""


from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from routeformer.compare.budgets import (
    FULL,
    QUICK,
    TASKS,
    CompareBudget,
    check_selection,
    lm_only,
    options_for,
    task_job,
    task_options,
)
from routeformer.compare.costs import measure_task_costs
from routeformer.compare.report import task_floor, write_compare_report
from routeformer.runner.jobs import Job, cached_run, run_jobs, say


def compare_jobs(tasks: list[str], mechanisms: list[str], budget: CompareBudget, corpus: str) -> list[Job]:
    """One job per (task, mechanism, seed); meta_tokens on the LM only."""
    jobs = []
    for task in tasks:
        setup = budget.tasks[task]
        if task == "lm":
            setup = replace(setup, options={**setup.options, "corpus": corpus})
        corpus_tag = "-" + corpus.replace(":", "_").replace("/", "_") if task == "lm" else ""
        for mechanism in mechanisms:
            if task != "lm" and lm_only(mechanism):
                continue
            for seed in range(budget.seeds):
                jobs.append(task_job(f"{budget.name}-{task}{corpus_tag}-{mechanism}-seed{seed}", task,
                                     mechanism, seed, setup, budget.spec))
    return jobs


def run_compare(
    out_dir: str | Path = "runs/compare", *, mechanisms: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None, quick: bool = False, corpus: str = "pydoc", bench: bool = True,
    budget: CompareBudget | None = None, seeds: int | None = None, workers: int = 2,
) -> Path:
    """Run the comparison described in the module docstring; returns the report's path.
    `budget` overrides the QUICK / FULL presets (tests run a toy one); `seeds` overrides its seeds."""
    budget = budget or (QUICK if quick else FULL)
    if seeds is not None:
        if not isinstance(seeds, int) or seeds < 1:
            raise ValueError(f"seeds must be a positive integer; got {seeds!r}")
        budget = replace(budget, seeds=seeds)
    mechanisms, tasks = check_selection(mechanisms, tasks, budget)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = compare_jobs(tasks, mechanisms, budget, corpus)
    began = time.perf_counter()
    say(f"compare ({budget.name}): {len(jobs)} runs = {len(tasks)} tasks x {len(mechanisms)} mechanisms x "
        f"{budget.seeds} seeds, {workers} worker process(es)")
    records = run_jobs(out, jobs, workers, say)
    by_task: dict[str, dict[str, list[dict[str, Any]]]] = {task: {} for task in tasks}
    failed: dict[str, dict[str, str]] = {task: {} for task in tasks}
    for job in jobs:
        record = records[job.key]
        if "error" in record:  # reported, and left out of the statistics
            failed[job.task][f"{job.mechanism} seed {job.seed}"] = record["error"]
        else:
            by_task[job.task].setdefault(job.mechanism, []).append(record)
    floors = {task: cached_run(out, f"{budget.name}-{task}-floor", lambda task=task: task_floor(
        task, dict(budget.tasks[task].options, **({"corpus": corpus} if task == "lm" else {}))))
        for task in tasks}

    def task_costs(task: str) -> dict[str, Any]:
        setup, costs = budget.tasks[task], {}
        for m in by_task[task]:
            try:
                costs[m] = measure_task_costs(task, m, setup, budget.spec, budget.repeats,
                                              task_options(task, m, setup), options_for)
            except Exception as error:  # noqa: BLE001 - a cost we could not measure is shown as "-"
                say(f"  costs of {m} on {task} not measured: {type(error).__name__}: {error}")
                costs[m] = {}
        return costs

    costs = {task: cached_run(out, f"{budget.name}-{task}-costs-{'-'.join(by_task[task])}",
                              lambda task=task: task_costs(task)) for task in tasks}
    bench_rows, bench_key = [], f"{budget.name}-bench-{'-'.join(mechanisms)}"
    kept_bench = not bench and (out / "runs" / f"{bench_key}.json").is_file()
    if bench:
        from routeformer.bench.layers_bench import bench_layers

        say(f"compare: layer benchmark at T = {list(budget.bench_lengths)}")
        bench_rows = cached_run(out, bench_key, lambda: {
            "rows": bench_layers(mechanisms, budget.bench_lengths, budget.repeats)})["rows"]
    elif kept_bench:  # --no-bench: what an earlier invocation measured stays in the report
        bench_rows = json.loads((out / "runs" / f"{bench_key}.json").read_text())["rows"]
        say("compare: --no-bench; the report keeps the layer benchmark an earlier invocation measured")
    say(f"compare: done in {time.perf_counter() - began:.0f} s")
    default_mechanisms = check_selection(None, None, budget)[0]
    command = "routeformer compare" + "".join([
        " --quick" if quick else "",
        f" --tasks {' '.join(tasks)}" if tasks != list(TASKS) else "",
        f" --mechanisms {' '.join(mechanisms)}" if mechanisms != default_mechanisms else "",
        f" --seeds {budget.seeds}" if seeds is not None else "",
        f" --corpus {corpus}" if corpus != "pydoc" else "", "" if bench else " --no-bench"])
    return write_compare_report(out, by_task, floors, costs, bench_rows, budget, command,
                                elapsed=time.perf_counter() - began, workers=workers, failed=failed,
                                bench_from_earlier=kept_bench)
