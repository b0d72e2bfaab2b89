"""The training jobs of `routeformer compare --long`: one per (task, mechanism, seed), each trained
through its task's curriculum stages and tested at T, 2T and 4T (compare/long_budget.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any

import torch

from routeformer.compare.budgets import lm_only, task_options
from routeformer.compare.long_budget import EVAL_MULTIPLES, LongSetup
from routeformer.runner.jobs import Job, say
from routeformer.tasks.registry import task_options as task_options_of
from routeformer.train.on_task import ModelSpec


def train_long_job(job: Job) -> dict[str, Any]:
    """Train one fresh model through the stages of the job's LongSetup; test it at T, 2T and 4T."""
    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model, evaluate_on_task, parameter_count
    from routeformer.train.task_loop import TaskTrainConfig, train_task

    name = job.setup.task_name(job.task)  # job.task is the setup's key (e.g. mqar_512 builds mqar)
    task = build_task(name, **job.task_options)
    torch.manual_seed(job.seed)
    model = build_task_model(task, job.mechanism, job.options, job.spec)

    def forward(model, inputs, labels):
        return model(inputs, labels, mask=stage_task.mask(inputs), logits_at_labels=True)

    validation, train_seconds, done = [], 0.0, 0
    total = sum(stage.schedule.steps for stage in job.setup.stages)
    say(f"  {job.key}: started ({total} steps in {len(job.setup.stages)} stages)")
    for index, stage in enumerate(job.setup.stages):
        stage_task = build_task(name, **{**job.task_options, **stage.options})
        length = stage_task.seq_len
        steps = stage.schedule.steps
        config = TaskTrainConfig(stage.schedule, seed=job.seed,
                                 eval_every=max(1, steps // job.setup.evals_per_stage))
        sequences = max(8, job.setup.validation_sequences * task.seq_len // length)
        history = train_task(
            model,
            lambda batch_size, generator, t=stage_task: t.batch(batch_size, generator, "train"),
            lambda m, t=stage_task, n=sequences: evaluate_on_task(m, t, "validation", n),
            config,
            forward=forward,
            log=lambda line, d=done, T=length: say(f"  {job.key}: T={T} {_progress(line, d, total)}"),
        )
        validation += [{**record, "stage": index, "task": stage_task.describe()} for record in history.evals]
        train_seconds += history.train_seconds
        done += steps
    tests = {}
    for multiple in (1, *EVAL_MULTIPLES):
        length = task.seq_len * multiple
        eval_task = build_task(name, **{**job.task_options, "seq_len": length})
        began = time.perf_counter()
        tests[str(length)] = {
            **evaluate_on_task(model, eval_task, "test", max(4, job.setup.test_tokens // length)),
            "seconds": time.perf_counter() - began,
        }
    return {
        "task": task.describe(),
        "task_name": name,
        "setup": job.task,
        "task_options": job.task_options,
        "mechanism": job.mechanism,
        "options": job.options,
        "seed": job.seed,
        "model": asdict(job.spec),
        "stages": [asdict(stage) for stage in job.setup.stages],
        "parameters": parameter_count(model),
        "validation": validation,
        "tests": tests,
        "quality": tests[str(task.seq_len)][task.metric],
        "train_seconds": train_seconds,
    }


def _progress(line: str, done: int, total: int) -> str:
    """`step=150 ...` of a stage -> `step=150 (650/1800) ...`: how far the whole run is."""
    head, _, rest = line.partition(" ")
    if not head.startswith("step="):
        return line
    return f"{head} ({done + int(head[5:])}/{total}) {rest}"


def long_jobs(
    tasks: dict[str, LongSetup], mechanisms: list[str], seeds: int, spec: ModelSpec, corpus: str
) -> list[Job]:
    """One job per (task, mechanism, seed); meta_tokens only on tasks that inject meta-tokens (an
    option `meta_density`: the LM tasks)."""
    jobs = []
    for task, setup in tasks.items():
        options = {**setup.options, "corpus": corpus} if task == "lm" else dict(setup.options)
        setup = replace(setup, options=options)
        for mechanism in mechanisms:
            if lm_only(mechanism) and "meta_density" not in task_options_of(setup.task_name(task)):
                continue  # meta-tokens are injected by the task: LM tasks only
            built = task_options(task, mechanism, setup.as_task_setup())
            for seed in range(seeds):
                jobs.append(
                    Job(
                        f"long-{task}-{mechanism}-seed{seed}",
                        task,
                        built,
                        mechanism,
                        setup.options_for(mechanism),
                        seed,
                        setup,
                        spec,
                    )
                )
    return jobs
