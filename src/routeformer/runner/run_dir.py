"""One task run in its own directory (`routeformer train --task`): the job compare would train,
stored the way compare stores its runs.

The directory holds `config.json` (the job: task and its options, mechanism and its options, seed,
schedule, backbone, and the training precision, AdamW betas and weight decay where they are not the
defaults) and, once the run has finished, its trained model as `checkpoint.pt` (the layout and
readers of `routeformer train`'s run directories, `train.checkpoint.save_task_model`: weights,
model config, task name and options, the tokeniser of a text task; `eval`, `sample`, `export-hf`
and `train.checkpoint.load_run_model` read it) and then `record.json` (train_on_task's record: the
validation history, the test metrics, the parameter count). The task loop's training checkpoints
`record.train<n>.pt` (and the job's `keep_checkpoints` - 1 before each, `.1.pt`, ...) sit beside
them, kept when the run finishes (`cached_record`, train/task_loop.py):
a run that is interrupted and started again resumes after its newest intact checkpoint (its last
evaluation, a `checkpoint_every` step, or the step Ctrl-C stopped it at) and ends with the same
weights and record as one that never stopped; with none intact, a directory where an earlier run
left metrics.jsonl lines or checkpoints moved aside as corrupt is refused rather than started over
(`fresh` starts over); a finished run is read back, not trained again
(`log` hears so). A directory holding a run of another config is refused with the differences named
(`fresh` starts over); the job's `log_every`, `checkpoint_every` and `keep_checkpoints` may change
(config.json then holds the new ones), and so may the schedule of a one-stage run (RESCHEDULE_KEYS:
steps, learning rate, warm-up, batch size, evaluations, validation and test sizes, AdamW's betas and
weight decay, the precision, the non-finite limit, the logged statistics): it continues
from its newest checkpoint on the new schedule (`train.task_loop.schedule_may_change`), the config
it replaces kept as `config.before-step<N>.json`. A finished run continues so only with more steps
than it has (its record.json then kept as `record.before-step<N>.json`, its final line in
metrics.jsonl left in place; when the longer run ends its model is checkpoint.pt and the earlier one
checkpoint.1.pt), and only from a
training checkpoint; a checkpoint past the new schedule's end is refused before anything is
written, and a staged run's schedule cannot change.
Nothing is written before the job's task builds with its options: a refused option leaves the
directory as it was.

While it trains, the run keeps `metrics.jsonl` (train/logging.py's `RunLog`), one JSON object a
line: one per validation evaluation as it is made, `{"step": N, "train_loss": ..., "aux_loss": ...,
"val_<metric>": ...}` (the validation metrics of the history's record, `val_` prefixed: val_loss,
val_accuracy, val_bits_per_char, ...; the training step's `attn_<key>` layer statistics of
`log_stats` as they are; a staged run's `step` counts over all its stages and the line names its
`stage`, 0 for the first), with the job's `log_every` a training line every that many updates
before them (`{"step": N, "loss": ..., "aux_loss": ..., "lr": ..., "grad_norm": ...,
"tokens_per_s": ...}`), `{"step": N, "skipped": message}` for an update the non-finite guard
skipped and, for a run resumed on a changed schedule, `{"step": N, "config_changes": {key: [before,
now]}}` at the step it continues from, then, once the record is made (before record.json is
stored), `{"step": N, "final": true, "test_<metric>": ...}` with the test at T. A
resumed run first drops the lines past the step it resumed after (RunLog's `resume_step`), so every
evaluation has one line; a finished run is read back and its file left as it is. With `logger`
"tensorboard" the same values also go to TensorBoard event files in `tensorboard/` (`.[tensorboard]`).
Runs outside a run directory (compare's `run_jobs`, the experiments) write no metrics.jsonl.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from routeformer.runner.jobs import Job, built_task, cached_record, job_config, keep_job_model, train_job
from routeformer.train.config import LOGGERS
from routeformer.train.logging import RunLog
from routeformer.train.progress import read_records
from routeformer.train.task_loop import SCHEDULE_FIELDS, schedule_may_change

CONFIG_FILE, RECORD_FILE, METRICS_FILE = "config.json", "record.json", "metrics.jsonl"
RESUME_LINE = "resumed from "  # how the task loop's log says it resumed (train/task_loop.py)


def run_in_directory(out_dir: str | Path, job: Job, *, fresh: bool = False,
                     log: Callable[[str], None] | None = None, logger: str = "jsonl") -> dict[str, Any]:
    """Train `job` in `out_dir` (or resume it, or read back its finished record); the record gains
    `resumed`: the loop's lines saying where it resumed (empty for a run that never stopped; a staged
    run's lines start with the stage's length, `T=16 resumed from ...`). The
    run's metrics go to `out_dir/metrics.jsonl` and, with `logger` "tensorboard", to TensorBoard too
    (module docstring; default "jsonl": metrics.jsonl alone).

    Raises ValueError, before anything is written, when `logger` is neither "jsonl" nor "tensorboard"
    (or is "tensorboard" without the tensorboard package), the job's task cannot be built with its
    options (at T and at every stage), its mechanisms with their options (TypeError for an option
    of the wrong type) or `out_dir` holds a run of another config.

    Inside `train.task_loop.distributed_training` with several processes every process calls it:
    process 0 alone prepares the directory (`fresh`, config.json), hears `log`, writes checkpoints,
    the model and the record, and returns the record; the others train alongside it and return {}
    (or the finished record, read back). When process 0 refuses the directory, every process raises."""
    from routeformer.train.distributed import any_rank
    from routeformer.train.resume import check_out_dir
    from routeformer.train.task_loop import distributed_context, training_checkpoints

    context = distributed_context()
    out_dir = Path(out_dir)
    _check_logger(logger)
    check_out_dir(out_dir)
    task = built_task(job)
    _check_layers(job, task.causal)
    record_path = out_dir / RECORD_FILE
    refused: Exception | None = None
    rescheduled: dict[str, tuple[Any, Any]] = {}
    step = 0
    if context.is_main:
        try:
            rescheduled, step = _prepare(out_dir, job, fresh)
        except (ValueError, OSError) as error:
            refused = error
    if any_rank(refused is not None, context):  # every process waits here for the directory
        if refused is not None:
            raise refused
        raise ValueError(f"{str(out_dir)!r}: process 0 refused the run directory (its error says why)")
    log = log if context.is_main else None
    resumed: list[str] = []
    if rescheduled and log is not None:
        from routeformer.train.resume import describe

        log(f"the run continues on a changed schedule: {describe(rescheduled)}")

    def hear(line: str) -> None:
        if _says_resumed(line):
            resumed.append(line)
        if log is not None:
            log(line)

    def train() -> dict[str, Any]:
        metrics = None
        if context.is_main:
            resuming = bool(training_checkpoints(out_dir, record_path.stem))
            metrics = _TaskMetrics(out_dir, logger, resuming=resuming, changes=rescheduled, step=step)
        try:
            record = train_job(job, log=hear,
                               keep_model=lambda model: keep_job_model(out_dir, job, model, task),
                               on_eval=None if metrics is None else metrics.evaluation)
            if metrics is not None and record:
                metrics.final(job.setup.total_steps,
                              record["test"] if "test" in record else record["tests"][str(task.seq_len)])
        finally:
            if metrics is not None:
                metrics.close()
        return {**record, "resumed": resumed} if record else record

    if record_path.is_file() and log is not None:
        log(f"already finished at step {job.setup.total_steps} ({RECORD_FILE} read back); nothing to "
            "train (more steps train on)")
    with schedule_may_change():  # _prepare let through only the schedule changes it accepts
        return cached_record(record_path, train, keep_training_state=True)


def _check_layers(job: Job, causal: bool) -> None:
    """Build one attention layer of each mechanism of `job` with its options, on the job's backbone,
    so that an unknown mechanism or option is refused before anything is written (ValueError or
    TypeError as `attention.registry.build_attention` and `train.on_task.layer_attention` raise)."""
    from routeformer.attention.registry import build_attention
    from routeformer.train.on_task import layer_attention

    attention, options = layer_attention(job.mechanism, job.options)
    for name in dict.fromkeys([attention] if isinstance(attention, str) else attention):
        build_attention(name, dim=job.spec.dim, heads=job.spec.heads, causal=causal, **options.get(name, {}))


def _says_resumed(line: str) -> bool:
    """Whether a progress line of `train_job` says where the run resumed (a staged run's lines start
    with their stage's length, `T=16 resumed from ...`)."""
    head, _, rest = line.partition(" ")
    return line.startswith(RESUME_LINE) or head.startswith("T=") and rest.startswith(RESUME_LINE)


class _TaskMetrics:
    """A task run directory's metrics.jsonl (module docstring) through `RunLog`. A fresh run (no
    training checkpoint in the directory) starts the file at once; a resumed one opens it at its first
    new evaluation, dropping the lines from that step on (the lines past the step it resumed after:
    none lie between), or, resumed as finished, at the final line, keeping every line. A run resumed
    on a changed schedule (`changes` {key: (before, now)}, continuing after `step`) opens it at once,
    dropping the lines past `step`, and writes `{"step": step, "config_changes": {key: [before,
    now]}}`."""

    def __init__(self, out_dir: Path, logger: str, *, resuming: bool,
                 changes: dict[str, tuple[Any, Any]], step: int) -> None:
        self.out_dir, self.logger = out_dir, logger
        self.log: RunLog | None = None
        if changes or not resuming:
            self.log = RunLog(out_dir, resume_step=step if resuming else None, logger=logger)
        if changes:
            self.log.write({"step": step,
                            "config_changes": {key: list(pair) for key, pair in changes.items()}})

    def evaluation(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.log is None:
            self.log = RunLog(self.out_dir, resume_step=step - 1, logger=self.logger)
        line = {"step": step, **({"stage": record["stage"]} if "stage" in record else {})}
        if "train_loss" not in record:  # a training or skipped-step line: as the task loop made it
            line.update({key: value for key, value in record.items() if key not in line})
        else:
            line.update({"train_loss": record["train_loss"], "aux_loss": record["aux_loss"]})
            line.update({key if key.startswith("attn_") else f"val_{key}": value
                         for key, value in record.items()
                         if key not in ("step", "stage", "train_loss", "aux_loss")})
        self.log.write(line)

    def final(self, step: int, test: dict[str, Any]) -> None:
        if self.log is None:  # resumed as finished: the evaluations' lines are all there
            self.log = RunLog(self.out_dir, resume_step=step, logger=self.logger)
            if any(line.get("final") and line["step"] == step for line in read_records(self.log.path)):
                return  # stopped between its final line and record.json: written once
        self.log.write({"step": step, "final": True, **{f"test_{key}": value for key, value in test.items()}})

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def _check_logger(logger: Any) -> None:
    """ValueError naming `logger` unless it is one of LOGGERS, or when it is "tensorboard" and the
    tensorboard package is missing."""
    if logger not in LOGGERS:
        raise ValueError(f"logger: one of {list(LOGGERS)}; got {logger!r}")
    if logger == "tensorboard":
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("logger 'tensorboard' needs the tensorboard package: "
                             "pip install 'routeformer[tensorboard]'") from None


# config.json keys (flattened) a resume of a one-stage run may change: its schedule, its evaluations
# and the job fields of the training settings train.task_loop.SCHEDULE_FIELDS lets change
RESCHEDULE_KEYS = ("setup.schedule.", "setup.evals", "setup.eval_every", "setup.validation_sequences",
                   "setup.test_sequences",
                   *(name for name in SCHEDULE_FIELDS if name not in ("schedule", "eval_every")))


def _prepare(out_dir: Path, job: Job, fresh: bool) -> tuple[dict[str, tuple[Any, Any]], int]:
    """Start over (`fresh`) or check that `out_dir` holds no run of another config, then write the
    job's config.json (ValueError naming the differences, before anything is written). Returns the
    schedule changes it accepted (`RESCHEDULE_KEYS`, {key: (before, now)}; only for a one-stage run,
    and for a finished one only with more steps: `_checked_reschedule`) and N, the step the run
    continues from (its newest training checkpoint's, 0 without one or without changes), the config
    it replaces kept as `config.before-step<N>.json`."""
    from routeformer.train.checkpoint import checkpoint_files, remove_checkpoints
    from routeformer.train.progress import write_text_atomic
    from routeformer.train.resume import describe, flatten
    from routeformer.train.task_loop import WATCH_FIELDS, training_checkpoints

    record_path, config_path = out_dir / RECORD_FILE, out_dir / CONFIG_FILE
    config = job_config(job)
    if fresh:
        for path in (record_path, config_path, out_dir / METRICS_FILE,
                     *training_checkpoints(out_dir, record_path.stem),
                     *out_dir.glob(f"{glob.escape(record_path.stem)}.train*.corrupt")):
            path.unlink(missing_ok=True)
        if out_dir.is_dir():
            remove_checkpoints(out_dir)
    if not config_path.is_file() and checkpoint_files(out_dir):
        raise ValueError(f"{str(out_dir)!r} holds checkpoints but no {CONFIG_FILE} of a task run (another "
                         "kind of run, such as an LM run of the earlier layout, which does not resume); use "
                         "--fresh to start over, or another --out")
    rescheduled: dict[str, tuple[Any, Any]] = {}
    step = 0
    if config_path.is_file():
        saved = json.loads(config_path.read_text())
        before, after = flatten(_with_defaults(saved)), flatten(_with_defaults(config))
        changes = {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
                   if before.get(key) != after.get(key) and key not in WATCH_FIELDS}
        rescheduled = changes if all(key.startswith(RESCHEDULE_KEYS) for key in changes) else {}
        if rescheduled and job.setup.staged:
            raise ValueError(f"{str(out_dir)!r} holds a staged run ({describe(changes)}): its schedule "
                             "cannot change when it resumes; use --fresh to start over, or another --out")
        if changes and not rescheduled:
            raise ValueError(f"{str(out_dir)!r} holds a run of another config ({describe(changes)}); "
                             "use --fresh to start over, or another --out")
        if rescheduled:
            step = _checked_reschedule(out_dir, job, record_path, describe(changes))
            write_text_atomic(out_dir / f"config.before-step{step}.json", json.dumps(saved, indent=1) + "\n")
            if record_path.is_file():  # a finished run trains on: its record is kept beside the config
                os.replace(record_path, out_dir / f"{record_path.stem}.before-step{step}.json")
    if not fresh and not record_path.is_file() and not step:  # step: a rescheduled run found one intact
        _check_nothing_lost(out_dir, record_path.stem)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(config_path, json.dumps(config, indent=1) + "\n")
    return rescheduled, step


def _checked_reschedule(out_dir: Path, job: Job, record_path: Path, changes: str) -> int:
    """The step the run in `out_dir` continues from on `job`'s changed schedule (`changes`, described):
    its newest intact training checkpoint's, 0 without one. Raises ValueError, before anything is
    written, when that step is past the job's steps, or when the run finished (`record_path` is
    there) and has no training checkpoint or no steps left to train."""
    from routeformer.train.checkpoint import checkpoint_files

    step = _intact_step(checkpoint_files(out_dir, f"{record_path.stem}.train0"))
    steps = job.setup.total_steps
    if step is not None and step > steps:
        raise ValueError(f"{str(out_dir)!r}: its newest checkpoint is at step {step}, past the {steps} "
                         f"steps the run now has; give at least {step}")
    if not record_path.is_file():
        return step or 0
    if step is None:
        raise ValueError(f"{str(out_dir)!r} holds a finished run ({changes}) without its training state "
                         "(no training checkpoint), which a longer run continues from; use --fresh to "
                         "start over, or another --out")
    if step == steps:
        raise ValueError(f"{str(out_dir)!r} holds a finished run ({changes}): it trains on only with more "
                         f"steps than the {step} it has; use --fresh to start over, or another --out")
    return step


def _check_nothing_lost(out_dir: Path, stem: str) -> None:
    """ValueError when an earlier run in `out_dir` left metrics.jsonl lines or training checkpoints
    moved aside as corrupt but no intact training checkpoint: starting over would replace them."""
    from routeformer.train.resume import earlier_run
    from routeformer.train.task_loop import training_checkpoints

    left = earlier_run(out_dir, f"{stem}.train")
    checkpoints = training_checkpoints(out_dir, stem)
    if not (left or checkpoints) or _intact_step(checkpoints) is not None:
        return
    what = " and ".join(part for part in (left, checkpoints and f"{len(checkpoints)} training checkpoint(s), "
                                          "none intact") if part)
    raise ValueError(f"{str(out_dir)!r} holds {what} but no intact checkpoint to resume from; not starting "
                     "over in it: use --fresh to start over (its metrics.jsonl is then replaced), or "
                     "another --out")


def _intact_step(paths: list[Path]) -> int | None:
    """The step of the first of the checkpoints `paths` that loads intact; None when none does."""
    from routeformer.train.checkpoint import CheckpointError, load_checkpoint

    for path in paths:
        try:
            return int(load_checkpoint(path)["step"])
        except CheckpointError:
            continue
    return None


def _with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's job with the fields `job_config` leaves out at their defaults filled in."""
    from routeformer.runner.jobs import JOB_FIELD_DEFAULTS
    from routeformer.train.on_task import SPEC_DEFAULTS
    from routeformer.train.task_loop import with_defaults

    filled = with_defaults(config, JOB_FIELD_DEFAULTS)
    if isinstance(filled.get("spec"), dict):
        filled["spec"] = with_defaults(filled["spec"], SPEC_DEFAULTS)
    return filled


__all__ = ["CONFIG_FILE", "METRICS_FILE", "RECORD_FILE", "built_task", "job_config", "keep_job_model",
           "run_in_directory"]
