"""Run `routeformer compare --long`: train every (task, mechanism, seed) job, then measure each task's
floors and each mechanism's costs (every finished piece stored under runs/, so a killed run resumes),
then write the report (compare/long_report.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from routeformer.compare.long_budget import EVAL_MULTIPLES
from routeformer.compare.long_costs import measure_long_costs, trained_routing_shares
from routeformer.compare.long_jobs import long_jobs, train_long_job
from routeformer.compare.long_report import write_long_report
from routeformer.compare.report import task_floor
from routeformer.runner.jobs import cached_run, run_jobs, say


def default_corpus() -> str:
    """Tiny Shakespeare where a local copy exists (../shared/data, ROUTEFORMER_DATA_DIR), else the
    embedded corpus: the long compare never downloads."""
    from routeformer.data.corpora import load_corpus

    try:
        load_corpus("tinyshakespeare")
        return "tinyshakespeare"
    except (OSError, ValueError):
        return "pydoc"


def run_compare_long(
    budget: Any,
    out_dir: str | Path = "runs/compare-long",
    *,
    mechanisms: list[str],
    tasks: list[str],
    seeds: int,
    workers: int = 2,
    corpus: str | None = None,
    command: str = "routeformer compare --long",
) -> Path:
    """Train, test and time every (task, mechanism, seed) of `budget`; returns report.md's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus or default_corpus()
    setups = {task: budget.tasks[task] for task in tasks}
    jobs = long_jobs(setups, mechanisms, seeds, budget.spec, corpus)
    began = time.perf_counter()
    say(
        f"compare --long: {len(jobs)} runs ({', '.join(tasks)}; {len(mechanisms)} mechanisms; "
        f"{seeds} seeds), {workers} worker process(es)" + (f"; lm's corpus {corpus}" if "lm" in tasks else "")
    )
    records = run_jobs(out, jobs, workers, say, train=train_long_job)
    train_elapsed = time.perf_counter() - began
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {task: {} for task in tasks}
    failed = {}
    for job in jobs:
        record = records[job.key]
        if "error" in record:
            failed[job.key] = record["error"]
        else:
            runs[job.task].setdefault(job.mechanism, []).append(record)
    options_of = {(job.task, job.mechanism): job.task_options for job in jobs}
    floors, costs = {}, {}
    for task in tasks:
        setup = next(job.setup for job in jobs if job.task == task)
        for multiple in (1, *EVAL_MULTIPLES):
            length = setup.seq_len * multiple
            floors[(task, length)] = cached_run(
                out,
                f"long-{task}-floor-{length}",
                lambda t=task, L=length, s=setup: task_floor(s.task_name(t), {**s.options, "seq_len": L},
                                                               max(4, s.test_tokens // L)),
            )
        for mechanism in runs[task]:
            say(f"compare --long: costs of {mechanism} on {task} (alternating with full)")
            costs[(task, mechanism)] = cached_run(
                out,
                f"long-{task}-costs-{mechanism}",
                lambda t=task, m=mechanism, s=setup: measure_long_costs(
                    s.task_name(t),
                    m,
                    s,
                    budget.spec,
                    lambda name, t=t: options_of.get((t, name), s.options),
                    budget.repeats,
                    trained_routing_shares(runs[t][m], s.seq_len),
                ),
            )
    elapsed = time.perf_counter() - began
    say(f"compare --long: done in {elapsed:.0f} s ({train_elapsed:.0f} s training)")
    return write_long_report(out, runs, floors, costs, budget, setups, command, elapsed, workers, failed)
