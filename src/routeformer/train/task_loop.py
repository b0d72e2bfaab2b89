"""Training on task batches (recall, counting, MQAR, ...): `train_task`, the entry point of compare
and the paper experiments. It runs the training driver of train/driver.py (AdamW, the batch
generator, the non-finite guard, the one loop of train/steps.py) with periodic evaluation.

Resuming: inside `resumable_training(directory, key)` (which `runner.jobs.cached_run` opens around
every run) each `train_task` call writes a checkpoint at every evaluation (and, with
`TaskTrainConfig.checkpoint_every`, every that many steps between them) — the state of
`steps.capture_state` (model, optimizer, step, the batch generator's and torch's RNG states) plus
the config and history — to `<directory>/<key>.train<n>.pt`, n counting the calls in the block, and
a later call with the same n resumes from it: an interrupted experiment re-runs nothing but the
steps after its last checkpoint (or after the step Ctrl-C stopped it at, below), and ends with the
same weights and history as an uninterrupted one. A finished call resumes as finished (its final
weights loaded), so a run that trains several models in turn skips the finished ones. Outside such
a block nothing is written. The checkpoints rotate as a run directory's do
(`train.checkpoint.save_rotating`): the newest `TaskTrainConfig.keep_checkpoints` stay
(`<key>.train<n>.pt`, then `.1.pt`, `.2.pt`, ...; default 2), and each is written in full before
an older one is renamed or deleted, so a crash while one is written leaves the ones before; a
corrupt checkpoint is reported and moved aside (`.corrupt`) and the call resumes from the next
older one, or starts over without one. Ctrl-C stops such a call at the next step boundary and saves
its checkpoint there (train/interrupts.py: a second Ctrl-C stops at once, keeping the last one), so
the resumed run repeats no step and still ends as one never interrupted; the KeyboardInterrupt
propagates after the save.

A step with a non-finite loss or gradient is skipped; `TaskTrainConfig.max_nonfinite_steps`
(default MAX_NONFINITE_STEPS) in a row stop the run (train/guard.py).

Precision: `TaskTrainConfig.precision` "bf16" runs each training forward under bfloat16 autocast on
the model's device (train/precision.py: CPU or CUDA, no gradient scaler); "fp16" under float16
autocast with a gradient scaler (CUDA only: ValueError on another device; the scaler's state is in
the checkpoint); parameters, AdamW's state and every evaluation stay fp32. "fp32" (the default)
runs the forward as it is.

Several processes: inside `distributed_training(context)` with a `DistributedContext` of more than
one process (`train.distributed.init_distributed`, under torchrun or with RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT set), `train_task` trains DistributedDataParallel as the LM
run does (train/distributed.py): the batch size is the global batch, every process draws it from
the same seeded generator and keeps its contiguous slice, the gradients are averaged over the
processes, and a step is skipped on all of them when its loss or gradient is non-finite on any.
Process 0 alone evaluates, logs and writes checkpoints (each holding every process's torch RNG
state, so a run resumed on as many processes continues as one never interrupted); the others
return an empty history. Logged training losses are the mean over the processes.
"""

from __future__ import annotations

import glob
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.train.checkpoint import CheckpointError, checkpoint_files, load_checkpoint, save_rotating
from routeformer.train.distributed import (
    DistributedContext,
    any_rank,
    check_shardable,
    gather_rng_states,
    local_shard,
    mean_over_ranks,
    rank_rng_state,
)
from routeformer.train.driver import Driver, warn
from routeformer.train.interrupts import DeferredInterrupts, InterruptedMidStep
from routeformer.train.precision import check_precision, gradient_scaler
from routeformer.train.progress import peak_memory_mib
from routeformer.train.schedule import Schedule
from routeformer.train.steps import StepResult

MAX_NONFINITE_STEPS = 10  # TaskTrainConfig.max_nonfinite_steps' default
TASK_PRECISIONS = ("fp32", "bf16", "fp16")  # the precisions of a task run; the first is the default
TASK_BETAS = (0.9, 0.999)  # AdamW's betas of a task run unless its config says otherwise


def check_task_precision(precision: Any, argument: str = "precision") -> None:
    """Raise ValueError naming `argument` unless `precision` is one of TASK_PRECISIONS."""
    if precision not in TASK_PRECISIONS:
        raise ValueError(f"{argument}: one of {list(TASK_PRECISIONS)}; got {precision!r}")


def _check_positive(value: Any, argument: str, what: str) -> None:
    """Raise ValueError "`argument`: a positive integer (`what`); got ..." unless `value` is one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument}: a positive integer ({what}); got {value!r}")


def check_nonfinite_limit(steps: Any, argument: str = "max_nonfinite_steps") -> None:
    """Raise ValueError naming `argument` unless `steps` is a positive integer."""
    _check_positive(steps, argument, "non-finite steps in a row that stop the run")


def check_interval(steps: Any, argument: str) -> None:
    """Raise ValueError naming `argument` unless `steps` is an integer >= 0 (0: never)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{argument}: an integer >= 0 (steps between two; 0: none); got {steps!r}")


def check_keep(count: Any, argument: str = "keep_checkpoints") -> None:
    """Raise ValueError naming `argument` unless `count` is a positive integer."""
    _check_positive(count, argument, "the newest checkpoints a run keeps")


def stat_names(names: Any, argument: str = "log_stats") -> list[str]:
    """`names` (a list or tuple of strings) as a list; ValueError naming `argument` otherwise."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"{argument}: a list of layer statistic names, e.g. ['routing_recall']; "
                         f"got {names!r}")
    return list(names)


def task_betas(betas: Any, argument: str = "betas") -> tuple[float, float]:
    """`betas` as AdamW's (beta1, beta2) tuple of floats: two real numbers, each in [0, 1) (a list is
    accepted). ValueError naming `argument` for anything else."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{argument}: two numbers in [0, 1) (beta1, beta2); got {betas!r}")
    values = []
    for beta in betas:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) \
                or not 0 <= beta < 1:
            raise ValueError(f"{argument}: two numbers in [0, 1) (beta1, beta2); got {betas!r}")
        values.append(float(beta))
    return values[0], values[1]


@dataclass
class TaskTrainConfig:
    """A task run: its schedule (steps, batch size, learning rate, warm-up, clipping), AdamW's weight
    decay, an evaluation every `eval_every` steps (and at the end), the seed of the weights and the
    batches, the `precision` of the training forward: "fp32" (default), "bf16" (bfloat16
    autocast) or "fp16" (float16 autocast with a gradient scaler, CUDA only; see the module
    docstring), AdamW's `betas` (default TASK_BETAS, (0.9, 0.999); a list is stored as a tuple of
    floats), `max_nonfinite_steps`, the non-finite steps in a row that stop the run (default
    MAX_NONFINITE_STEPS), and `log_stats`: per-layer statistics of the training step (keys of the
    layers' `stats`, e.g. "routing_recall") each evaluation record holds as `attn_<key>`, the mean
    over the layers that report it (default none). Three settings say how the run is watched, not what
    it trains (a resumed run may change them): `log_every`, a training line every that many updates
    and at the last (step, loss, aux_loss, lr, grad_norm, tokens_per_s, peak_mem_mib and the
    `log_stats`, handed to the `evaluations_to` listener; default 0: none), `checkpoint_every`,
    a checkpoint every that many steps between the evaluations' (inside `resumable_training`;
    default 0: at evaluations only), and `keep_checkpoints`, the newest checkpoints kept (default 2:
    `<key>.train<n>.pt` and the one before, `.1.pt`).
    ValueError naming `precision`, `betas`, `max_nonfinite_steps`, `log_stats`, `log_every`,
    `checkpoint_every` or `keep_checkpoints` for a bad value."""
    schedule: Schedule = Schedule(steps=1000, batch_size=32, lr=1e-3, warmup_steps=50)
    weight_decay: float = 0.1
    eval_every: int = 100
    seed: int = 0
    precision: str = TASK_PRECISIONS[0]
    betas: tuple[float, float] = TASK_BETAS
    max_nonfinite_steps: int = MAX_NONFINITE_STEPS
    log_stats: list[str] = field(default_factory=list)
    log_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        check_task_precision(self.precision)
        self.betas = task_betas(self.betas)
        check_nonfinite_limit(self.max_nonfinite_steps)
        self.log_stats = stat_names(self.log_stats)
        check_interval(self.log_every, "log_every")
        check_interval(self.checkpoint_every, "checkpoint_every")
        check_keep(self.keep_checkpoints)


# TaskTrainConfig fields added after checkpoints and records were first written, with their defaults:
# a reader fills them in where a saved config lacks them (`with_defaults`)
TRAIN_FIELD_DEFAULTS: dict[str, Any] = {"precision": TASK_PRECISIONS[0], "betas": TASK_BETAS,
                                        "max_nonfinite_steps": MAX_NONFINITE_STEPS, "log_stats": [],
                                        "log_every": 0, "checkpoint_every": 0, "keep_checkpoints": 2}
# TaskTrainConfig fields that say how a run is watched, not what it trains: a resumed run may change them
WATCH_FIELDS = ("log_every", "checkpoint_every", "keep_checkpoints")
# TaskTrainConfig fields a resume inside `schedule_may_change` may change: the schedule and how the
# optimizer, the forward's precision and the guard treat the steps still to come
SCHEDULE_FIELDS = ("schedule", "eval_every", "precision", "betas", "weight_decay", "max_nonfinite_steps",
                   "log_stats")


def json_form(value: Any) -> Any:
    """`value` as JSON gives it back (tuples become lists)."""
    return json.loads(json.dumps(value))


def without_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`data` in JSON form without the keys of `defaults` that hold their default value (so a saved
    form reads as it did before those fields existed)."""
    return {key: value for key, value in json_form(data).items()
            if key not in defaults or value != json_form(defaults[key])}


def with_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`data` in JSON form with the keys of `defaults` it lacks filled in (`without_defaults`' inverse)."""
    return json_form({**defaults, **data})


def train_config_dict(config: TaskTrainConfig) -> dict[str, Any]:
    """`config` as a run's record holds it: its fields, but `betas`, `max_nonfinite_steps`,
    `log_stats`, `log_every`, `checkpoint_every` and `keep_checkpoints` only where they are not their
    defaults (so the record of a run with the defaults reads as before the fields existed)."""
    return without_defaults(asdict(config), {key: value for key, value in TRAIN_FIELD_DEFAULTS.items()
                                             if key != "precision"})


@dataclass
class TaskHistory:
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Resumable:
    directory: Path
    key: str
    calls: int = 0

    def next_path(self) -> Path:
        path = self.directory / f"{self.key}.train{self.calls}.pt"
        self.calls += 1
        return path


_RESUMABLE: ContextVar[_Resumable | None] = ContextVar("routeformer_resumable_training", default=None)
_DISTRIBUTED: ContextVar[DistributedContext | None] = ContextVar("routeformer_distributed_training",
                                                                 default=None)
_EVALUATIONS: ContextVar[Callable[[dict[str, Any]], None] | None] = ContextVar(
    "routeformer_evaluation_listener", default=None)
_DEVICE: ContextVar[torch.device | None] = ContextVar("routeformer_training_device", default=None)
_SCHEDULE_MAY_CHANGE: ContextVar[bool] = ContextVar("routeformer_schedule_may_change", default=False)
_SINGLE_PROCESS = DistributedContext()


@contextmanager
def distributed_training(context: DistributedContext) -> Iterator[None]:
    """Train every `train_task` call inside the block on the processes of `context` (see the module
    docstring); a single-process context changes nothing. The process group is the caller's to set
    up (`init_distributed`) and tear down (`finish_distributed`)."""
    token = _DISTRIBUTED.set(context)
    try:
        yield
    finally:
        _DISTRIBUTED.reset(token)


def distributed_context() -> DistributedContext:
    """The processes task training runs on here: the innermost `distributed_training` block's
    context, else the single process."""
    return _DISTRIBUTED.get() or _SINGLE_PROCESS


def is_main_process() -> bool:
    """Whether this process evaluates, logs and writes files: always outside `distributed_training`,
    and process 0 of several inside it."""
    return distributed_context().is_main


@contextmanager
def training_on(device: torch.device | str) -> Iterator[None]:
    """Build the model of every task run inside the block (`train.on_task.train_on_task`,
    `runner.jobs.train_job`) on `device` (a torch device or its name, e.g. "cuda:0"), where
    `train_task` and `train.on_task.evaluate_on_task` move each batch to (outside: the CPU).
    Raises ValueError naming `device` unless torch knows it."""
    try:
        token = _DEVICE.set(torch.device(device))
    except (RuntimeError, TypeError):
        raise ValueError(f"device: a torch device such as 'cpu' or 'cuda:0'; got {device!r}") from None
    try:
        yield
    finally:
        _DEVICE.reset(token)


def training_device() -> torch.device:
    """The device task runs build their models on here: the innermost `training_on` block's, else
    the CPU."""
    return _DEVICE.get() or torch.device("cpu")


@contextmanager
def resumable_training(directory: str | Path, key: str) -> Iterator[None]:
    """Checkpoint and resume every `train_task` call inside the block (see the module docstring)."""
    token = _RESUMABLE.set(_Resumable(Path(directory), key))
    try:
        yield
    finally:
        _RESUMABLE.reset(token)


@contextmanager
def schedule_may_change() -> Iterator[None]:
    """Inside the block a `train_task` call resumes from a checkpoint written with another schedule
    (SCHEDULE_FIELDS: more steps, another learning rate or batch size, other evaluation steps, and
    AdamW's betas and weight decay, the precision, the non-finite limit, the logged statistics): it
    continues from the checkpoint's step, with its weights, optimizer and generator states, on the
    new schedule and settings (the optimizer takes the new betas and weight decay). A checkpoint
    past the new schedule's last step is a ValueError. Outside the block any change is refused (a
    sweep never resumes a run as another); `runner.run_dir` opens it for a run directory whose
    schedule the user changed."""
    token = _SCHEDULE_MAY_CHANGE.set(True)
    try:
        yield
    finally:
        _SCHEDULE_MAY_CHANGE.reset(token)


@contextmanager
def evaluations_to(listener: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Hand each evaluation of the `train_task` calls inside the block to `listener(record)` as it is
    made: a copy of the record its history gains (`step`, `train_loss`, `aux_loss` and the evaluation's
    metrics), before that evaluation's checkpoint is saved; with `TaskTrainConfig.log_every`, each
    training line too (`step`, `loss`, `aux_loss`, `lr`, `grad_norm`, `tokens_per_s`, `peak_mem_mib`,
    `attn_<key>`: told from an evaluation by having no `train_loss`), before that step's evaluation,
    and `{"step": N, "skipped": message}` for an update the non-finite guard skipped.
    Evaluations a resumed call reads back from its checkpoint are not handed over again; processes
    other than 0 hand over nothing."""
    token = _EVALUATIONS.set(listener)
    try:
        yield
    finally:
        _EVALUATIONS.reset(token)


def training_checkpoints(directory: str | Path, key: str) -> list[Path]:
    """The checkpoint files `resumable_training(directory, key)` has written."""
    return sorted(Path(directory).glob(f"{glob.escape(key)}.train*.pt"))


def _save(path: Path, state: dict[str, Any], config: TaskTrainConfig) -> None:
    """Save `state` as the checkpoint `path` (`<key>.train<n>.pt`), keeping `config.keep_checkpoints`."""
    save_rotating(path.parent, state, keep=config.keep_checkpoints, stem=path.stem)


def _resume_intact(path: Path, config: TaskTrainConfig, driver: Driver, log: Callable[[str], None] | None,
                   say: Callable[[str], None], is_main: bool) -> TaskHistory | None:
    """The history of the newest intact checkpoint of `path` and the older ones kept beside it
    (`checkpoint_files(path.parent, path.stem)`: `<key>.train<n>.pt`, `.1.pt`, ...), its state
    restored into `driver` (`_resume`); None when none is there intact. A corrupt one is reported
    and moved aside (`.corrupt`, by process 0) and the next older tried; without one the call starts
    over."""
    candidates = checkpoint_files(path.parent, path.stem)
    for index, candidate in enumerate(candidates):
        try:
            history = _resume(candidate, config, driver)
        except CheckpointError as error:  # nothing was restored
            if is_main:
                os.replace(candidate, candidate.with_name(candidate.name + ".corrupt"))
                then = (f"resuming from {candidates[index + 1].name}" if index + 1 < len(candidates)
                        else "this run starts over")
                say(f"{error}; moved aside, {then}")
            continue
        if log:
            log(f"resumed from {candidate.name} after step {driver.step}")
        return history
    return None


def _resume(path: Path, config: TaskTrainConfig, driver: Driver) -> TaskHistory:
    """The history so far from the checkpoint at `path`, its state restored into `driver`
    (ValueError when it was written with another training config: inside `schedule_may_change`,
    one that differs in more than SCHEDULE_FIELDS, or whose step is past the new schedule's end)."""
    state = load_checkpoint(path)
    ignored = SCHEDULE_FIELDS if _SCHEDULE_MAY_CHANGE.get() else ()
    if _trained(with_defaults(state["config"], TRAIN_FIELD_DEFAULTS), ignored) \
            != _trained(json_form(asdict(config)), ignored):
        raise ValueError(f"checkpoint {str(path)!r} was written with another training config "
                         f"({state['config']}, now {asdict(config)}); delete it to start this run afresh")
    if state["step"] > config.schedule.steps:
        raise ValueError(f"checkpoint {str(path)!r} is at step {state['step']}, past the "
                         f"{config.schedule.steps} steps the run now has; give at least {state['step']}")
    reseeded = driver.restore(state)
    if reseeded and driver.context.is_main:
        warn(reseeded)
    return TaskHistory(**state["history"])


def _skipped(step: int, message: str, say: Callable[[str], None], is_main: bool) -> None:
    """Tell of the update the non-finite guard skipped at `step` (process 0 also hands
    `{"step": step, "skipped": message}` to the `evaluations_to` listener)."""
    say(message)
    if is_main and (listener := _EVALUATIONS.get()) is not None:
        listener({"step": step, "skipped": message})


def _trained(config: dict[str, Any], ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """A training config's JSON form without WATCH_FIELDS (and `ignored`): what a resumed run must
    train as before."""
    return {key: value for key, value in config.items() if key not in WATCH_FIELDS + ignored}


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(iter(model.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def layer_stat(stats: list[dict[str, Tensor]], key: str) -> float | None:
    """Mean of one per-layer diagnostic over the layers that report it."""
    values = [float(layer[key]) for layer in stats if key in layer]
    return sum(values) / len(values) if values else None


def train_task(
    model: nn.Module, make_batch: Callable[[int, torch.Generator], tuple[Tensor, Tensor]],
    evaluate: Callable[[nn.Module], dict[str, Any]], config: TaskTrainConfig,
    forward: Callable[[nn.Module, Tensor, Tensor], Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> TaskHistory:
    """Train `model` on fresh batches `make_batch(batch_size, generator)`: (inputs, labels) or
    (inputs, labels, extra), `extra` a dict of tensors [B, ...] the forward also takes (a task's
    `training_batch`); `forward(model, inputs, labels, **extra)` returns a ModelOutput (default:
    `model(inputs, labels, **extra)`), each batch moved to the model's device; `evaluate(model)` runs every
    `eval_every` steps and at the end, in eval mode. AdamW runs with `config.betas`;
    `config.precision` sets the training forward's autocast (fp32: none). Inside
    `distributed_training` with several processes the model trains DistributedDataParallel
    (`forward` gets the wrapped model) and only process 0 evaluates, logs, checkpoints and returns
    the history (module docstring); ValueError when the batch size is not divisible by the number
    of processes."""
    schedule = config.schedule
    context = distributed_context()
    check_shardable(schedule.batch_size, context)
    device = _device_of(model)
    log = log if context.is_main else None
    say = warn if context.is_main else (lambda message: None)
    forward = forward or (lambda m, inputs, labels, **extra: m(inputs, labels, **extra))
    check_precision(config.precision, device)
    driver = Driver(model, schedule=schedule, seed=config.seed, weight_decay=config.weight_decay,
                    betas=config.betas, max_nonfinite=config.max_nonfinite_steps, device=device,
                    on_skip=lambda step, message: _skipped(step, message, say, context.is_main),
                    context=context,
                    scaler=gradient_scaler("fp16", device) if config.precision == "fp16" else None)
    history = TaskHistory()
    resumable = _RESUMABLE.get()
    checkpoint = None if resumable is None else resumable.next_path()
    if checkpoint is not None:
        history = _resume_intact(checkpoint, config, driver, log, say, context.is_main) or history
    began = time.perf_counter()

    def next_batch() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        inputs, labels, *more = make_batch(schedule.batch_size, driver.generator)
        extra = more[0] if more else {}
        if context.enabled:  # this process's slice of the global batch
            inputs, labels = local_shard(inputs, context), local_shard(labels, context)
            extra = {name: local_shard(value, context) for name, value in extra.items()}
        return inputs.to(device), labels.to(device), {name: value.to(device) for name, value in extra.items()}

    watched = [time.perf_counter(), driver.step]  # when and at which step the last training line was

    def log_training(result: StepResult) -> None:
        """The training line of an update at a multiple of `log_every` or the last step (every process
        joins the mean)."""
        if not config.log_every or result.step % config.log_every and result.step != schedule.steps:
            return
        output = result.output
        losses = mean_over_ranks(torch.stack([output.loss.detach().float(),
                                              output.aux_loss.detach().float()]), context)
        if not context.is_main:
            return
        now = time.perf_counter()
        tokens = result.inputs.numel() * context.world_size * (result.step - watched[1])
        line = {"step": result.step, "loss": losses[0].item(), "aux_loss": losses[1].item(),
                "lr": result.rate, "grad_norm": float(result.grad_norm),
                "tokens_per_s": tokens / max(now - watched[0], 1e-9), "peak_mem_mib": peak_memory_mib(device)}
        watched[:] = [now, result.step]
        for key in config.log_stats:
            if (value := layer_stat(output.stats, key)) is not None:
                line[f"attn_{key}"] = value
        if (listener := _EVALUATIONS.get()) is not None:
            listener(dict(line))
        if log:
            log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()))

    def evaluate_now(result: StepResult) -> None:
        nonlocal began
        step = result.step
        if step % config.eval_every and step != schedule.steps:
            if checkpoint is not None and config.checkpoint_every and step % config.checkpoint_every == 0:
                history.train_seconds += time.perf_counter() - began
                with interrupts.critical():
                    save_now(step)
                began = time.perf_counter()
            return
        history.train_seconds += time.perf_counter() - began
        output = result.output
        if context.enabled:  # every process joins the reductions and the RNG gathering
            losses = mean_over_ranks(torch.stack([output.loss.detach().float(),
                                                  output.aux_loss.detach().float()]), context)
            train_loss, aux_loss = losses.tolist()
            rank_states = gather_rng_states(context, device) if checkpoint is not None else None
        else:
            train_loss, aux_loss, rank_states = output.loss.item(), output.aux_loss.item(), None
        if context.is_main:
            model.eval()  # the step loop puts it back in train mode
            record = {"step": step, "train_loss": train_loss, "aux_loss": aux_loss, **evaluate(model)}
            for key in config.log_stats:  # this process's training step
                if (value := layer_stat(output.stats, key)) is not None:
                    record[f"attn_{key}"] = value
            history.evals.append(record)
            if (listener := _EVALUATIONS.get()) is not None:  # before the checkpoint: a resume redoes it
                listener(dict(record))
            if log:
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in record.items()))
            if checkpoint is not None:  # after evaluating: the RNG state includes what it drew
                saved = driver.capture(step, config=asdict(config), history=asdict(history))
                if rank_states is not None:  # process 0's own state as it stands after evaluating
                    saved["rng"]["ranks"] = [rank_rng_state(device), *rank_states[1:]]
                with interrupts.critical():
                    _save(checkpoint, saved, config)
        began = time.perf_counter()

    def save_now(step: int) -> None:
        """The checkpoint at the step boundary after `step`, between evaluations (every process joins)."""
        rank_states = gather_rng_states(context, device)
        if context.is_main:
            saved = driver.capture(step, config=asdict(config), history=asdict(history))
            if rank_states is not None:
                saved["rng"]["ranks"] = rank_states
            _save(checkpoint, saved, config)

    def save_at_boundary() -> None:
        """The checkpoint of a run stopped by Ctrl-C at a step boundary (every process joins)."""
        history.train_seconds += time.perf_counter() - began
        save_now(driver.step)
        if log:
            log(f"interrupted: saved {checkpoint.name} after step {driver.step}")

    # Ctrl-C stops a resumable run at the next step boundary, saved there (train/interrupts.py)
    interrupts = DeferredInterrupts(agree=lambda flag: any_rank(flag, context))
    if checkpoint is not None:
        interrupts.install()
    try:
        driver.train(next_batch,
                     lambda trained, inputs, labels, extra: forward(trained, inputs, labels, **extra),
                     precision=config.precision, on_update=log_training, on_step_end=evaluate_now,
                     interrupts=interrupts if checkpoint is not None else None)
    except KeyboardInterrupt as interrupt:
        if checkpoint is not None and driver.position.at_boundary \
                and not isinstance(interrupt, InterruptedMidStep):
            with interrupts.critical(raise_after=False):
                save_at_boundary()
        raise
    finally:
        interrupts.restore()
    if not context.is_main:
        return TaskHistory(train_seconds=history.train_seconds)
    history.final = history.evals[-1]
    return history
