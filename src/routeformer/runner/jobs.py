"""The experiments' runner. `cached_run` stores each finished run as JSON (resume after a kill);
`Job`/`run_jobs` train (task, mechanism, options, seed) runs in worker processes; a `Call` is a run
of a model that is no task model (a regressor, a ViT), trained by `run_jobs` the same way.

Training runs as independent jobs: one (task, mechanism, options, seed, budget, backbone) each,
stored as JSON when finished (so an interrupted sweep resumes after its finished runs, and inside a
run after its last evaluation), run in worker processes with one thread each — tiny models use one
core better than two, so two processes train twice as many models on a 2-core machine.

Progress: each run prints a line on stderr when it starts and at each of its evaluations
(`  mqar-topk-s0: step=150/600 ... validation accuracy ...`, from the worker that trains it), and
the sweep prints a line as each run finishes (`[3/24] key: quality (elapsed)`)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from routeformer.runner.setups import Stage, TaskSetup
from routeformer.train.on_task import ModelSpec, spec_dict
from routeformer.train.task_loop import (
    MAX_NONFINITE_STEPS,
    TASK_BETAS,
    TASK_PRECISIONS,
    TRAIN_FIELD_DEFAULTS,
    TaskTrainConfig,
    check_interval,
    check_keep,
    check_nonfinite_limit,
    check_task_precision,
    json_form,
    stat_names,
    task_betas,
    without_defaults,
)

MODELS_FOLDER = "models"  # where run_jobs keeps trained models (keep_models)
TASK_WEIGHT_DECAY = TaskTrainConfig().weight_decay  # a job's AdamW weight decay unless it says otherwise
# Job fields added after config.json files were first written, with their defaults: `job_config`
# leaves a field out while it has its default, and run_dir fills it back in to compare
JOB_FIELD_DEFAULTS: dict[str, Any] = {**TRAIN_FIELD_DEFAULTS, "weight_decay": TASK_WEIGHT_DECAY}


def cached_run(out_dir: Path, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Return the stored record of run `key`, or compute and store it (atomically): a killed
    experiment picks up after its last finished run, and within the unfinished run after the last
    evaluation of its `train_task` calls (`train.task_loop.resumable_training`); those checkpoints
    are deleted once the record is stored."""
    return cached_record(out_dir / "runs" / f"{key}.json", compute)


def cached_record(path: Path, compute: Callable[[], dict[str, Any]], *,
                  keep_training_state: bool = False) -> dict[str, Any]:
    """`cached_run` for a record at `path` (`<stem>.json`): the stored record, or `compute()` run
    inside `resumable_training(path.parent, stem)` (checkpoints `<stem>.train<n>.pt` and the ones
    before them, `<stem>.train<n>.1.pt`, ..., beside it, deleted once the record is stored atomically,
    unless `keep_training_state`: a run directory keeps them, so that a finished run can train on).
    Inside `train.task_loop.distributed_training` only process 0 stores the record and deletes the
    checkpoints; the others return what `compute()` returned."""
    from routeformer.train.task_loop import is_main_process, resumable_training, training_checkpoints

    if path.exists():
        return json.loads(path.read_text())
    key = path.stem
    with resumable_training(path.parent, key):
        record = compute()
    if not is_main_process():
        return record
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)
    for checkpoint in [] if keep_training_state else training_checkpoints(path.parent, key):
        checkpoint.unlink()
    return record


def run_key(name: str) -> str:
    """A file-name-safe key for a variant name: "topk(K=32,distill)" -> "topk-K32-distill"."""
    return name.replace(",", "-").replace("=", "").replace("(", "-").replace(")", "")


@dataclass(frozen=True)
class Job:
    """One training run (module docstring); `precision`, `betas` and `weight_decay` are its stages'
    `TaskTrainConfig.precision` (ValueError naming it unless "fp32", "bf16" or "fp16"), AdamW betas
    (`TaskTrainConfig.betas`: two numbers in [0, 1), default TASK_BETAS; ValueError naming it
    otherwise) and AdamW weight decay (`TaskTrainConfig.weight_decay`, on matrices only: a finite
    number >= 0, default TASK_WEIGHT_DECAY; ValueError naming it otherwise); `max_nonfinite_steps`,
    `log_stats`, `log_every`, `checkpoint_every` and `keep_checkpoints` are `TaskTrainConfig`'s
    (defaults MAX_NONFINITE_STEPS, none, 0, 0 and 2; a run directory resumed with other `log_every`,
    `checkpoint_every` or `keep_checkpoints` takes them). The backbone's `spec.tie_embeddings` ties
    the output head to the embedding. `mechanism` is one registered name (every layer runs it with
    `options`) or a list of names, one per layer, with `options` keyed by name
    (`train.on_task.layer_attention`)."""

    key: str  # file-name-safe and unique within an output directory
    task: str
    task_options: dict[str, Any]
    mechanism: str | list[str]
    options: dict[str, Any]
    seed: int
    setup: TaskSetup  # `task` is its name in the budget (`setup.task_name(task)` builds the task)
    spec: ModelSpec = field(default_factory=ModelSpec)
    precision: str = TASK_PRECISIONS[0]  # of every stage's training forward: fp32, bf16, fp16 (CUDA)
    betas: tuple[float, float] = TASK_BETAS  # AdamW's, in every stage
    weight_decay: float = TASK_WEIGHT_DECAY  # AdamW's, in every stage
    max_nonfinite_steps: int = MAX_NONFINITE_STEPS  # non-finite steps in a row that stop a stage
    log_stats: list[str] = field(default_factory=list)  # layer statistics each evaluation holds (attn_<key>)
    log_every: int = 0  # a training line every that many updates (0: none)
    checkpoint_every: int = 0  # a checkpoint every that many steps between evaluations (0: none)
    keep_checkpoints: int = 2  # the newest training checkpoints kept (<key>.train<n>.pt, .1.pt, ...)

    def __post_init__(self) -> None:
        check_task_precision(self.precision)
        check_nonfinite_limit(self.max_nonfinite_steps)
        check_interval(self.log_every, "log_every")
        check_interval(self.checkpoint_every, "checkpoint_every")
        check_keep(self.keep_checkpoints)
        object.__setattr__(self, "log_stats", stat_names(self.log_stats))
        object.__setattr__(self, "betas", task_betas(self.betas))
        decay = self.weight_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not math.isfinite(decay) \
                or decay < 0:
            raise ValueError(f"weight_decay: a finite number >= 0; got {decay!r}")
        object.__setattr__(self, "weight_decay", float(decay))


@dataclass(frozen=True)
class Call:
    """A run that is one call, `function(**arguments)` -> its JSON-ready record, stored under `key`
    (file-name-safe, unique within an output directory): what `run_jobs(..., train=call)` trains for
    a model outside the task layer. `function` is a module-level function and `arguments` picklable
    values, so that worker processes can run it; it should train on one thread, as `run_jobs` gives
    each job."""

    key: str
    function: Callable[..., dict[str, Any]]
    arguments: dict[str, Any] = field(default_factory=dict)


def call(job: Call) -> dict[str, Any]:
    """`run_jobs`' train for `Call` jobs: the record `job.function(**job.arguments)` returns."""
    return job.function(**job.arguments)


def train_job(job: Job, log: Callable[[str], None] | None = None,
              keep_model: Callable[[Any], None] | None = None,
              on_eval: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train one fresh model through the stages of the job's setup, then test it at T and at each of
    its evaluation multiples (see runner/setups.py), on `train.task_loop.training_device()` (the
    CPU unless inside `training_on(device)`; a record trained elsewhere names its `device`). `log`
    hears the run's progress lines (default: `say`, prefixed with the job's key); `keep_model(model)`
    is called with the trained model once it is tested, before the record is returned (a run
    directory saves it there). `on_eval(record)`
    (None: nothing) hears each validation evaluation as it is made, before its checkpoint is saved
    (not those a resumed run reads back): the validation history's record (`step`, `train_loss`,
    `aux_loss`, the task's validation metrics), for a staged setup with `step` counted over the whole
    run and `stage`, the index of the stage. The record returned is the same with or without it.

    A one-stage setup tested at T alone gives train.on_task's record (`train`, `validation`, `test`);
    a staged one gives the record of `staged_record` (each evaluation's stage, `tests` per length).
    Inside `train.task_loop.distributed_training` with several processes, processes other than 0
    train alongside process 0 and return {} without testing or calling `keep_model`."""
    import torch

    from routeformer.tasks import build_task
    from routeformer.train.on_task import build_task_model, train_on_task, train_stages
    from routeformer.train.task_loop import is_main_process, training_device

    setup = job.setup
    name = setup.task_name(job.task)
    task = build_task(name, **job.task_options)
    total = setup.total_steps
    configs = [TaskTrainConfig(stage.schedule, eval_every=setup.eval_every_in(stage.schedule.steps),
                               seed=job.seed, precision=job.precision, betas=job.betas,
                               weight_decay=job.weight_decay, max_nonfinite_steps=job.max_nonfinite_steps,
                               log_stats=job.log_stats, log_every=job.log_every,
                               checkpoint_every=job.checkpoint_every, keep_checkpoints=job.keep_checkpoints)
               for stage in setup.stages]
    log = log or (lambda line: say(f"  {job.key}: {line}"))
    if not setup.staged:
        log(f"started ({total} steps)")
        record = train_on_task(task, job.mechanism, job.options, seed=job.seed, train=configs[0],
                               spec=job.spec, validation_sequences=setup.validation_sequences,
                               test_sequences=setup.test_sequences,
                               log=lambda line: log(_with_total(line, total)),
                               after_training=None if keep_model is None else _kept_by(keep_model),
                               on_eval=on_eval)
        if not is_main_process():
            return {}
        return {**record, "task_name": job.task, "task_options": job.task_options, **_device_entry()}
    log(f"started ({total} steps in {len(setup.stages)} stages)")
    done = [sum(stage.schedule.steps for stage in setup.stages[:index]) for index in range(len(setup.stages))]
    torch.manual_seed(job.seed)
    model = build_task_model(task, job.mechanism, job.options, job.spec).to(training_device())
    stage_tasks: list[Any] = []  # each built when its stage begins

    def stage(index: int) -> tuple[Any, Any, int]:
        built = build_task(name, **{**job.task_options, **setup.stages[index].options})
        stage_tasks.append(built)
        return built, configs[index], setup.validation_sequences_at(built.seq_len, task.seq_len)

    histories = train_stages(
        model, (stage(index) for index in range(len(configs))),
        lambda index, t: lambda line: log(f"T={t.seq_len} {_with_progress(line, done[index], total)}"),
        on_eval=None if on_eval is None else lambda index, record: on_eval(
            {**record, "step": done[index] + record["step"], "stage": index}))
    if not is_main_process():
        return {}
    validation = [{**record, "stage": index, "task": t.describe()}
                  for index, (t, history) in enumerate(zip(stage_tasks, histories, strict=True))
                  for record in history.evals]
    record = {**staged_record(job, task, model, validation, sum(h.train_seconds for h in histories)),
              **_device_entry()}
    if keep_model is not None:
        keep_model(model)
    return record


def _device_entry() -> dict[str, str]:
    """{"device": name} of a run trained off the CPU (`train.task_loop.training_on`); {} on the CPU,
    so that CPU records keep their shape."""
    from routeformer.train.task_loop import training_device

    device = training_device()
    return {} if device.type == "cpu" else {"device": str(device)}


def _kept_by(keep_model: Callable[[Any], None]) -> Callable[[Any], dict[str, Any]]:
    """`train_on_task`'s after_training hook that hands the model to `keep_model` and adds nothing
    to the record."""
    def after_training(model: Any) -> dict[str, Any]:
        keep_model(model)
        return {}

    return after_training


def staged_record(job: Job, task: Any, model: Any, validation: list[dict[str, Any]],
                  train_seconds: float) -> dict[str, Any]:
    """A staged run's record: `model` (trained) tested at T and, forward only, at each evaluation
    multiple (`tests`, by length), beside the validation history of every stage."""
    from routeformer.tasks import build_task
    from routeformer.train.on_task import evaluate_on_task, parameter_count

    setup, tests = job.setup, {}
    for multiple in (1, *setup.eval_multiples):
        length = task.seq_len * multiple
        eval_task = build_task(setup.task_name(job.task), **{**job.task_options, "seq_len": length})
        began = time.perf_counter()
        tests[str(length)] = {**evaluate_on_task(model, eval_task, "test", setup.test_sequences_at(multiple)),
                              "seconds": time.perf_counter() - began}
    return {
        "task": task.describe(), "task_name": setup.task_name(job.task), "setup": job.task,
        "task_options": job.task_options, "mechanism": job.mechanism, "options": job.options,
        "seed": job.seed, "precision": job.precision,
        **({} if job.betas == TASK_BETAS else {"betas": list(job.betas)}),
        **({} if job.weight_decay == TASK_WEIGHT_DECAY else {"weight_decay": job.weight_decay}),
        "model": spec_dict(job.spec),
        "stages": [asdict(stage) for stage in setup.stages],
        "parameters": parameter_count(model), "validation": validation, "tests": tests,
        "quality": tests[str(task.seq_len)][task.metric], "train_seconds": train_seconds,
    }


def say(line: str) -> None:
    """A progress line on stderr, flushed at once (worker processes share the terminal)."""
    print(line, file=sys.stderr, flush=True)


def _with_total(line: str, steps: int) -> str:
    """`step=150 ...` -> `step=150/600 ...` (the run's evaluation lines say how far it is)."""
    head, _, rest = line.partition(" ")
    return f"{head}/{steps} {rest}" if head.startswith("step=") else line


def _with_progress(line: str, done: int, total: int) -> str:
    """`step=150 ...` of a stage -> `step=150 (650/1800) ...`: how far the whole run is."""
    head, _, rest = line.partition(" ")
    if not head.startswith("step="):
        return line
    return f"{head} ({done + int(head[5:])}/{total}) {rest}"


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block (as every training job runs), the caller's count after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run_one(out: Path, job: Any, threads: int | None,
             train: Callable[[Any], dict[str, Any]] | None = None,
             keep_models: bool = False, device: str = "cpu") -> tuple[str, dict[str, Any]]:
    """The job's record, its model trained on `device`; a job that raises gives {"error": ...} (not
    stored: a re-run retries it), so one broken mechanism costs its own runs, not the whole sweep.
    `keep_models` (with `train` None): the trained model is saved as the run directory
    `out/models/<key>` (`run_dir.keep_job_model`)."""
    import torch

    from routeformer.train.task_loop import training_on

    if threads is not None:
        torch.set_num_threads(threads)

    def compute() -> dict[str, Any]:
        if train is not None:
            return train(job)
        if not keep_models:
            return train_job(job)
        folder = out / MODELS_FOLDER / job.key
        return train_job(job, keep_model=lambda model: keep_job_model(folder, job, model))

    try:
        with training_on(device):
            return job.key, cached_run(out, job.key, compute)
    except Exception as error:  # noqa: BLE001 - reported per job, the others go on
        return job.key, {"error": f"{type(error).__name__}: {error}", "quality": float("nan")}


def run_jobs(out: Path, jobs: list[Job] | list[Call], workers: int, progress: Callable[[str], None],
             timeout_s: float | None = None, train: Callable[[Any], dict[str, Any]] | None = None,
             keep_models: bool = False, device: str = "cpu") -> dict[str, dict]:
    """Every job's record, by key. Finished jobs are read from `out/runs/` (a `Job`'s only when the
    record is a run of it: `check_stored`, ValueError otherwise); the others run in
    `workers` spawned processes (or in this one when workers == 1), each job on one thread (so a
    record does not depend on `workers`).

    The wait for the worker processes is bounded by `timeout_s` (None: by the jobs themselves — a
    sweep's runs take what its budget says, up to hours): past it, the workers are stopped and a
    TimeoutError names the unfinished runs. A worker that dies (killed, out of memory) stops the
    sweep with a RuntimeError naming the runs it left; so does an interrupt (Ctrl-C), after
    stopping the workers instead of waiting for their runs. Finished runs are stored either way,
    and a re-run resumes after them. `train(job)` makes a job's record (a module-level function:
    worker processes import it; `call` for `Call` jobs); None: `train_job` (train once, test once),
    and with `keep_models` each trained model is kept as the task run directory `out/models/<key>`.
    `device` (a torch device name, default "cpu") is where every job's model trains
    (`train.task_loop.training_on`, in each worker); a record trained elsewhere says so (`"device"`).

    Raises ValueError naming `device` unless torch knows it, and naming the stored record when a
    finished run in `out/runs/` was trained on another kind of device (its numbers are not this
    sweep's: use another `out`)."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer; got {workers!r}")
    kind = device_kind(device)
    began = time.perf_counter()
    records: dict[str, dict[str, Any]] = {}

    def note(key: str, record: dict[str, Any]) -> None:
        records[key] = record
        outcome = (f"FAILED ({record['error']})" if "error" in record
                   else f"{record['quality']:.4g}" if "quality" in record else "done")
        elapsed = time.perf_counter() - began
        progress(f"  [{len(records)}/{len(jobs)}] {key}: {outcome} ({elapsed:.0f} s elapsed)")

    pending = []
    for job in jobs:  # finished runs are read here: no worker process is started for them
        stored = out / "runs" / f"{job.key}.json"
        if stored.exists():
            record = json.loads(stored.read_text())
            if "error" not in record and device_kind(record.get("device", "cpu")) != kind:
                raise ValueError(f"device: {str(stored)!r} was trained on {record.get('device', 'cpu')}, "
                                 f"this sweep trains on {device}; use another output directory")
            if isinstance(job, Job):
                check_stored(stored, record, job)
            note(job.key, record)
        else:
            pending.append(job)
    if workers == 1 or len(pending) <= 1:
        with one_thread():  # as in a worker process
            for job in pending:
                note(*_run_one(out, job, None, train, keep_models, device))
        return records
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: a forked child inherits the parent's OpenMP thread pool in a broken state
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(min(workers, len(pending)), mp_context=context)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    futures = {pool.submit(_run_one, out, job, 1, train, keep_models, device): job.key for job in pending}
    waiting = set(futures)
    try:
        while waiting:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, waiting = wait(waiting, timeout=remaining, return_when=FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"run_jobs: {len(waiting)} run(s) unfinished after {timeout_s:g} s in "
                                   f"{workers} worker processes, which were stopped: "
                                   f"{sorted(futures[f] for f in waiting)}")
            for future in done:
                try:
                    note(*future.result())
                except BrokenProcessPool as error:
                    unfinished = sorted(futures[f] for f in (waiting | done) if futures[f] not in records)
                    raise RuntimeError(f"run_jobs: a worker process died (killed or crashed); runs left "
                                       f"unfinished: {unfinished}") from error
    except BaseException:
        _stop_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return records


def check_stored(path: Path, record: dict[str, Any], job: Job) -> None:
    """ValueError naming `path` and what differs unless the stored `record` is a run of `job`: the same
    mechanism, layer options, seed and backbone (`spec_dict`), those of them the record holds (a
    record of the same key from another budget or backbone must not stand in for this job's run)."""
    expected = json_form({"mechanism": job.mechanism, "options": job.options, "seed": job.seed,
                          "model": spec_dict(job.spec)})
    differs = [f"{name} {record[name]!r}, this job {value!r}" for name, value in expected.items()
               if name in record and json_form(record[name]) != value]
    if differs:
        raise ValueError(f"{str(path)!r} holds another run under this job's key ({'; '.join(differs)}); "
                         "delete it or use another output directory")


def finished_records(records: dict[str, dict[str, Any]], experiment: str) -> dict[str, dict[str, Any]]:
    """`run_jobs`' records, once none of them failed. Raises RuntimeError naming `experiment` and
    each failed run's key with its error (a re-run of the experiment retries them)."""
    failed = {key: record["error"] for key, record in records.items() if "error" in record}
    if failed:
        raise RuntimeError(f"{experiment}: runs failed (a re-run retries them): {failed}")
    return records


def device_kind(device: str) -> str:
    """The kind of the torch device named `device` ("cpu", "cuda", ...); ValueError naming `device`
    unless torch knows it."""
    import torch

    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"device: a torch device such as 'cpu' or 'cuda:0'; got {device!r}") from None


def _stop_workers(pool) -> None:
    """End a process pool's workers now (a pool's own shutdown waits for their running jobs)."""
    kill = getattr(pool, "kill_workers", None)  # Python >= 3.14
    processes = list((getattr(pool, "_processes", None) or {}).values())
    if kill is not None:
        kill()
    else:
        for process in processes:
            if process.is_alive():
                process.terminate()
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(10)


def job_config(job: Job) -> dict[str, Any]:
    """The job as JSON-ready data (what config.json holds; a one-stage setup as it read before setups
    had stages, `precision` only where it is not the default fp32, `betas` only where they are not
    TASK_BETAS, `weight_decay` only where it is not TASK_WEIGHT_DECAY, `max_nonfinite_steps`,
    `log_stats`, `log_every`, `checkpoint_every` and `keep_checkpoints` only where they are not
    their defaults (JOB_FIELD_DEFAULTS), and the backbone as `spec_dict` gives it, so earlier run
    directories resume)."""
    return without_defaults({**asdict(job), "setup": job.setup.as_dict(), "spec": spec_dict(job.spec)},
                            JOB_FIELD_DEFAULTS)


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
    if not (out_dir / "config.json").is_file():
        write_text_atomic(out_dir / "config.json", json.dumps(config, indent=1) + "\n")
    vocab = getattr(task, "vocab", None)  # the text tasks' tokeniser (lm, code_lm)
    return save_task_model(out_dir, model, step=job.setup.total_steps,
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
