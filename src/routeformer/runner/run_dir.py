"""One task run in its own directory (`routeformer train --task`): the job compare would train,
stored the way compare stores its runs.

The directory holds `config.json` (the job: task and its options, mechanism and its options, seed,
schedule, backbone) and, once the run has finished, its trained model as `checkpoint.pt` (the
layout and readers of `routeformer train`'s run directories, `train.checkpoint.save_task_model`:
weights, model config, task name and options, the tokeniser of a text task; `eval`, `sample`,
`export-hf` and `train.checkpoint.load_run_model` read it) and then `record.json` (train_on_task's
record: the validation history, the test metrics, the parameter count). While it trains, the task
loop's checkpoints `record.train<n>.pt` sit beside them (`cached_record`, train/task_loop.py): a
run that is interrupted and started again resumes after its last evaluation and ends with the same
weights and record as one that never stopped; a finished run is read back, not trained again. A
directory holding a run of another config is refused with the differences named (`fresh` starts
over). Nothing is written before the job's task builds with its options: a refused option leaves
the directory as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from routeformer.runner.jobs import Job, cached_record, train_job
from routeformer.runner.setups import Stage

CONFIG_FILE, RECORD_FILE = "config.json", "record.json"
RESUME_LINE = "resumed from "  # how the task loop's log says it resumed (train/task_loop.py)


def job_config(job: Job) -> dict[str, Any]:
    """The job as JSON-ready data (what config.json holds; a one-stage setup as it read before setups
    had stages, so earlier run directories resume)."""
    return json.loads(json.dumps({**asdict(job), "setup": job.setup.as_dict()}))


def run_in_directory(out_dir: str | Path, job: Job, *, fresh: bool = False,
                     log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train `job` in `out_dir` (or resume it, or read back its finished record); the record gains
    `resumed`: the loop's lines saying where it resumed (empty for a run that never stopped).

    Raises ValueError, before anything is written, when the job's task cannot be built with its
    options (at T and at every stage) or `out_dir` holds a run of another config."""
    from routeformer.train.checkpoint import checkpoint_files, remove_checkpoints
    from routeformer.train.progress import write_text_atomic
    from routeformer.train.resume import check_out_dir, describe, flatten
    from routeformer.train.task_loop import training_checkpoints

    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    task = built_task(job)
    record_path, config_path = out_dir / RECORD_FILE, out_dir / CONFIG_FILE
    config = job_config(job)
    if fresh:
        for path in (record_path, config_path, *training_checkpoints(out_dir, record_path.stem)):
            path.unlink(missing_ok=True)
        if out_dir.is_dir():
            remove_checkpoints(out_dir)
    if not config_path.is_file() and checkpoint_files(out_dir):
        raise ValueError(f"{str(out_dir)!r} holds checkpoints but no {CONFIG_FILE} of a task run (another "
                         "kind of run); use --fresh to start over, or another --out")
    if config_path.is_file():
        before, after = flatten(json.loads(config_path.read_text())), flatten(config)
        changes = {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
                   if before.get(key) != after.get(key)}
        if changes:
            raise ValueError(f"{str(out_dir)!r} holds a run of another config ({describe(changes)}); "
                             "use --fresh to start over, or another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(config_path, json.dumps(config, indent=1) + "\n")
    resumed: list[str] = []

    def hear(line: str) -> None:
        if line.startswith(RESUME_LINE):
            resumed.append(line)
        if log is not None:
            log(line)

    return cached_record(record_path, lambda: {
        **train_job(job, log=hear, keep_model=lambda model: keep_job_model(out_dir, job, model, task)),
        "resumed": resumed})


def keep_job_model(out_dir: str | Path, job: Job, model: Any, task: Any = None) -> Path:
    """Save `job`'s trained `model` as the checkpoint of run directory `out_dir`
    (`train.checkpoint.save_task_model`, beside the job's config: what `load_run_model`, eval,
    sample, export-hf and sparsify read); `task`, the job's built task (None: built here), gives a
    text task's tokeniser. Returns the checkpoint's path."""
    from routeformer.train.checkpoint import save_task_model
    from routeformer.train.progress import write_text_atomic

    out_dir = Path(out_dir)
    task = built_task(job) if task is None else task
    config = job_config(job)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / CONFIG_FILE).is_file():
        write_text_atomic(out_dir / CONFIG_FILE, json.dumps(config, indent=1) + "\n")
    vocab = getattr(task, "vocab", None)  # the text tasks' tokeniser (lm, code_lm)
    return save_task_model(out_dir, model, step=sum(stage.schedule.steps for stage in job.setup.stages),
                           task=job.setup.task_name(job.task), task_options=job.task_options, run=config,
                           vocab=None if vocab is None else vocab.to_dict())


def built_task(job: Job) -> Any:
    """The job's task at T, once every stage's task has been built too (a bad option is refused
    before a run directory is touched). ValueError naming the task, its options and the reason."""
    from routeformer.tasks import build_task

    name, built = job.setup.task_name(job.task), None
    for stage in (Stage({}, job.setup.schedule), *job.setup.curriculum):
        options = {**job.task_options, **stage.options}
        try:
            task = build_task(name, **options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"task {name!r} cannot be built with options {options}: {error}") from None
        if built is None:
            built = task
    return built
