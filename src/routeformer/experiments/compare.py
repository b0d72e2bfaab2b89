"""`routeformer compare`: mechanisms trained on the same `routeformer.tasks` tasks, seeds and budget.

Per task (`TaskSetup`) every mechanism gets the same backbone (`ModelSpec`), the same optimiser
schedule and, per seed, the same batches (the batch stream depends on the seed only); only the
attention layers differ. Quality is the task's metric on its test split, reported as mean ± sd
over the seeds beside the task's chance level and the measured accuracy of its shortcut rules.

Length-dependent budgets (the only options that differ from a mechanism's defaults): local
windows T/4, top-k T/8 keys, MiTA T/8 landmarks of T/8 keys (causal: blocks of T/8),
Meta-Attention's local expert T/4.
`meta_tokens` needs injected meta-tokens: it runs on the LM only, whose windows then carry
`_PAUSE_` at density 0.1 (so it reads 10% fewer characters per window: stated in the report).

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from routeformer.experiments.compare_costs import measure_task_costs
from routeformer.experiments.compare_report import task_floor, write_compare_report
from routeformer.experiments.jobs import Job, TaskSetup, cached_run, run_jobs, say
from routeformer.train.on_task import ModelSpec

TASKS = ("lm", "mqar", "listops")
LM_ONLY = ("meta_tokens",)  # mechanisms that need injected meta-tokens
META_DENSITY = 0.1


@dataclass(frozen=True)
class CompareBudget:
    name: str
    tasks: dict[str, TaskSetup]
    seeds: int = 3
    spec: ModelSpec = field(default_factory=ModelSpec)
    mechanisms: tuple[str, ...] | None = None  # the default selection; None = every registered one
    bench_lengths: tuple[int, ...] = (1024, 4096)
    repeats: int = 5


# Quick: the setups below were chosen on validation accuracy of `full` (seeds 0-2), never on the
# test numbers the report shows. MQAR: plain attention learns it through a phase transition whose
# timing varies by seed; at T = 32 with 4 pairs it came within 600 steps for every seed only with a
# small vocabulary (16: 7 keys, 8 values) and a long warm-up (200 steps); with vocabulary 32 or a
# 50-100-step warm-up, seeds 1-2 stayed at 1/pairs. ListOps: T = 32 holds the short expressions
# (mean 14 tokens), half the cost of T = 64 at the same rule baselines. The mechanisms are the
# subset that fits in 10 minutes on 2 cores (see README).
QUICK = CompareBudget(
    "quick",
    tasks={
        "lm": TaskSetup({"corpus": "pydoc", "seq_len": 128}, steps=300, batch_size=32, lr=3e-3,
                        warmup_steps=30, test_sequences=256),
        "mqar": TaskSetup({"seq_len": 32, "pairs": 4, "vocab_size": 16}, steps=600, batch_size=64, lr=3e-3,
                          warmup_steps=200),
        "listops": TaskSetup({"seq_len": 32, "max_length": 31}, steps=1200, batch_size=64, lr=3e-3,
                             warmup_steps=100),
    },
    spec=ModelSpec(dim=64, depth=2, heads=2, mlp_ratio=2.0, positions="rotary"),
    # MiTA left out for time: with it the quick budget took 11.8 min on 2 idle cores (706 s in
    # compare); `--mechanisms full linear local topk mita` runs it at the same setups.
    mechanisms=("full", "linear", "local", "topk"),
    bench_lengths=(1024, 4096), repeats=5,
)
FULL = CompareBudget(
    "full",
    tasks={
        "lm": TaskSetup({"corpus": "pydoc", "seq_len": 256}, steps=1500, batch_size=32, lr=3e-3,
                        warmup_steps=100, test_sequences=512),
        "mqar": TaskSetup({"seq_len": 64, "pairs": 8, "vocab_size": 64}, steps=3000, batch_size=64, lr=3e-3,
                          warmup_steps=200),
        "listops": TaskSetup({"seq_len": 128, "max_length": 127, "max_depth": 4}, steps=2000, batch_size=64,
                             lr=3e-3, warmup_steps=200),
    },
    spec=ModelSpec(dim=128, depth=2, heads=4, mlp_ratio=2.0, positions="rotary"),
    bench_lengths=(1024, 4096, 16384), repeats=5,
)


def options_for(mechanism: str, seq_len: int) -> dict[str, Any]:
    """The length-dependent budgets of the module docstring; every other option at its default."""
    if mechanism in ("local", "meta"):  # meta: the window of its local expert
        return {"window": max(1, seq_len // 4)}
    if mechanism == "topk":
        return {"topk": max(1, seq_len // 8)}
    if mechanism == "mita":  # causal: blocks of T/8, every completed block's landmark read
        budget = max(1, seq_len // 8)
        return {"landmarks": budget, "topk": budget, "block": budget}
    return {}


def task_options(task: str, mechanism: str, setup: TaskSetup) -> dict[str, Any]:
    """What `build_task` gets for `mechanism`: the setup's options (+ meta-tokens for meta_tokens)."""
    if mechanism in LM_ONLY:
        return {**setup.options, "meta_density": META_DENSITY}
    return dict(setup.options)


def check_selection(
    mechanisms: Sequence[str] | None, tasks: Sequence[str] | None, budget: CompareBudget | None = None,
) -> tuple[list[str], list[str]]:
    """Validate --mechanisms / --tasks against the registry; None = the budget's default (all)."""
    from routeformer.attention import list_attentions

    registered = list(list_attentions())
    default = list(budget.mechanisms) if budget is not None and budget.mechanisms else registered
    mechanisms = list(mechanisms or sorted(default, key=lambda name: name != "full"))  # full first
    tasks = list(tasks or TASKS)
    unknown = [m for m in mechanisms if m not in registered]
    if unknown:
        raise ValueError(f"mechanisms: unknown {unknown}; registered: {registered}")
    bad_tasks = [t for t in tasks if t not in TASKS]
    if bad_tasks:
        raise ValueError(f"tasks: unknown {bad_tasks}; valid: {list(TASKS)}")
    if not mechanisms or not tasks:
        raise ValueError("mechanisms and tasks must each name at least one")
    return mechanisms, tasks


def compare_jobs(tasks: list[str], mechanisms: list[str], budget: CompareBudget, corpus: str) -> list[Job]:
    """One job per (task, mechanism, seed); meta_tokens on the LM only."""
    jobs = []
    for task in tasks:
        setup = budget.tasks[task]
        if task == "lm":
            setup = replace(setup, options={**setup.options, "corpus": corpus})
        corpus_tag = "-" + corpus.replace(":", "_").replace("/", "_") if task == "lm" else ""
        for mechanism in mechanisms:
            if task != "lm" and mechanism in LM_ONLY:
                continue
            options = task_options(task, mechanism, setup)
            seq_len = options["seq_len"]
            for seed in range(budget.seeds):
                jobs.append(Job(f"{budget.name}-{task}{corpus_tag}-{mechanism}-seed{seed}", task, options,
                                mechanism, options_for(mechanism, seq_len), seed, setup, budget.spec))
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


def budget_summary(budget: CompareBudget) -> dict[str, Any]:
    return {"name": budget.name, "seeds": budget.seeds, "model": asdict(budget.spec),
            "tasks": {task: asdict(setup) for task, setup in budget.tasks.items()},
            "bench_lengths": list(budget.bench_lengths), "repeats": budget.repeats}
