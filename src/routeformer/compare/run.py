"""`routeformer compare`: mechanisms trained on the same `routeformer.tasks` tasks, seeds and budget.

Per task (`TaskSetup`) every mechanism gets the same backbone (`ModelSpec`), the same optimiser
schedule and, per seed, the same batches (the batch stream depends on the seed only); only the
attention layers differ. Quality is the task's metric on its test split, reported as mean ± sd
over the seeds beside the task's chance level and the measured accuracy of its shortcut rules.

The budgets (QUICK, FULL, LONG) and the options each mechanism gets are in compare/budgets.py. A
budget's task setup may train in stages and be tested at multiples of its length (runner/setups.py;
`compare --long`): its floors and costs are then measured at every length, its costs beside `full`.

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
    default_corpus,
    lm_only,
    task_job,
    with_backbone,
)
from routeformer.compare.costs import task_costs
from routeformer.compare.report import task_floor, write_compare_report
from routeformer.runner.jobs import Job, cached_run, device_kind, run_jobs, say
from routeformer.runner.seeds import seed_grid
from routeformer.runner.setups import MIN_TEST_SEQUENCES


def compare_jobs(tasks: list[str], mechanisms: list[str], budget: CompareBudget, corpus: str) -> list[Job]:
    """One job per (task, mechanism, seed); a mechanism that needs injected meta-tokens only on tasks
    that inject them (an option `meta_density`: the LM tasks)."""
    from routeformer.tasks.registry import task_options as options_of_task

    jobs = []
    for task in tasks:
        setup = budget.tasks[task]
        if task == "lm":
            setup = replace(setup, options={**setup.options, "corpus": corpus})
        named = task == "lm" and budget.corpus_in_keys
        corpus_tag = "-" + corpus.replace(":", "_").replace("/", "_") if named else ""
        kept = [mechanism for mechanism in mechanisms
                if not lm_only(mechanism) or "meta_density" in options_of_task(setup.task_name(task))]
        for mechanism, seed in seed_grid(kept, range(budget.seeds), seed_major=False):
            jobs.append(task_job(f"{budget.name}-{task}{corpus_tag}-{mechanism}-seed{seed}", task,
                                 mechanism, seed, setup, budget.spec))
    return jobs


def model_arguments(model: dict[str, Any]) -> str:
    """The `--model.KEY VALUE` arguments that state `model` on compare's command line ("" for none)."""
    return "".join(f" --model.{key} {str(value).lower() if isinstance(value, bool) else value}"
                   for key, value in model.items())


def task_floors(out: Path, budget: CompareBudget, task: str, setup: Any) -> dict[int, dict[str, Any]]:
    """The task's chance level and shortcut rules (`task_floor`), by length: at T (key
    `{budget}-{task}-floor`); a staged setup at T and every evaluation multiple (`...-floor-{length}`,
    with the LM's n-gram floors per position bucket on as many test windows as its runs read)."""
    name = setup.task_name(task)
    if not setup.staged:
        return {0: cached_run(out, f"{budget.name}-{task}-floor", lambda: task_floor(name, setup.options))}
    return {length: cached_run(out, f"{budget.name}-{task}-floor-{length}", lambda length=length, m=multiple:
                               task_floor(name, {**setup.options, "seq_len": length},
                                          max(MIN_TEST_SEQUENCES, setup.test_sequences_at(m))))
            for multiple, length in zip((1, *setup.eval_multiples), setup.lengths, strict=True)}


def run_compare(
    out_dir: str | Path = "runs/compare", *, mechanisms: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None, quick: bool = False, corpus: str | None = None, bench: bool = True,
    budget: CompareBudget | None = None, seeds: int | None = None, workers: int = 2,
    command: str | None = None, device: str = "cpu", model: dict[str, Any] | None = None,
) -> Path:
    """Run the comparison described in the module docstring; returns the report's path.
    `budget` overrides the QUICK / FULL presets (LONG, or a toy one in tests); `seeds` overrides its
    seeds; `corpus` the LM's (None: the budget's); `command`, the command the report names (None:
    the `routeformer compare` these arguments make); `device`, the torch device every run trains on
    (`runner.jobs.run_jobs`; default "cpu"; the costs are measured on the CPU either way), named in
    the report's command (and so in result.json's invocations) when it is not the CPU; `model`, the
    backbone fields to change (`{"dim": 32}`: `budgets.with_backbone`, whose runs are stored under
    keys of their own), named in the report's command as `--model.KEY VALUE`.

    Raises ValueError naming `device` as `run_jobs` does (before training: unknown to torch, or
    `out_dir` holding runs trained on another kind of device), and naming a bad `model` field as
    `train.on_task.spec_with` does (before anything is written)."""
    budget = with_backbone(budget or (QUICK if quick else FULL), model or {})
    if seeds is not None:
        if not isinstance(seeds, int) or seeds < 1:
            raise ValueError(f"seeds must be a positive integer; got {seeds!r}")
        budget = replace(budget, seeds=seeds)
    mechanisms, tasks = check_selection(mechanisms, tasks, budget)
    device_kind(device)  # an unknown device is refused before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus or budget.corpus or default_corpus()
    jobs = compare_jobs(tasks, mechanisms, budget, corpus)
    setups = {job.task: job.setup for job in jobs}  # the LM's with the corpus it trains on
    setups.update({task: budget.tasks[task] for task in tasks if task not in setups})
    began = time.perf_counter()
    say(f"compare ({budget.name}): {len(jobs)} runs = {len(tasks)} tasks x {len(mechanisms)} mechanisms x "
        f"{budget.seeds} seeds, {workers} worker process(es)"
        + (f"; lm's corpus {corpus}" if "lm" in tasks else ""))
    records = run_jobs(out, jobs, workers, say, keep_models=budget.keep_models, device=device)
    by_task: dict[str, dict[str, list[dict[str, Any]]]] = {task: {} for task in tasks}
    failed: dict[str, dict[str, str]] = {task: {} for task in tasks}
    for job in jobs:
        record = records[job.key]
        if "error" in record:  # reported, and left out of the statistics
            failed[job.task][f"{job.mechanism} seed {job.seed}"] = record["error"]
        else:
            by_task[job.task].setdefault(job.mechanism, []).append(record)
    floors = {task: task_floors(out, budget, task, setups[task]) for task in tasks}
    options_of = {(job.task, job.mechanism): job.task_options for job in jobs}
    costs = {task: task_costs(out, budget, task, setups[task], by_task[task],
                              lambda name, task=task: options_of.get((task, name), setups[task].options))
             for task in tasks}
    bench_rows, bench_key = [], f"{budget.name}-bench-{'-'.join(mechanisms)}"
    kept_bench = not bench and (out / "runs" / f"{bench_key}.json").is_file()
    if bench and budget.bench_lengths:
        from routeformer.bench.layers_bench import bench_layers

        say(f"compare: layer benchmark at T = {list(budget.bench_lengths)}")
        bench_rows = cached_run(out, bench_key, lambda: {
            "rows": bench_layers(mechanisms, budget.bench_lengths, budget.repeats)})["rows"]
    elif kept_bench:  # --no-bench: what an earlier invocation measured stays in the report
        bench_rows = json.loads((out / "runs" / f"{bench_key}.json").read_text())["rows"]
        say("compare: --no-bench; the report keeps the layer benchmark an earlier invocation measured")
    say(f"compare: done in {time.perf_counter() - began:.0f} s")
    default_mechanisms = check_selection(None, None, budget)[0]
    command = command or "routeformer compare" + "".join([
        " --quick" if quick else "",
        f" --tasks {' '.join(tasks)}" if tasks != list(TASKS) else "",
        f" --mechanisms {' '.join(mechanisms)}" if mechanisms != default_mechanisms else "",
        f" --seeds {budget.seeds}" if seeds is not None else "",
        f" --corpus {corpus}" if corpus != "pydoc" else "", "" if bench else " --no-bench",
        f" --device {device}" if device != "cpu" else "",
        model_arguments(model or {})])
    return write_compare_report(out, by_task, floors, costs, bench_rows, budget, command, setups=setups,
                                elapsed=time.perf_counter() - began, workers=workers, failed=failed,
                                bench_from_earlier=kept_bench)
