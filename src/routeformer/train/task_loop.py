"""Training on task batches (recall, counting, MQAR, ...): `train_task`, the entry point of compare
and the paper experiments. It runs the one loop of train/steps.py (AdamW, warmup + cosine,
clipping, the non-finite guard) with periodic evaluation.

Resuming: inside `resumable_training(directory, key)` (which `runner.jobs.cached_run` opens
around every run) each `train_task` call writes a checkpoint at every evaluation — the state of
`steps.capture_state` (model, optimizer, step, the batch generator's and torch's RNG states) plus
the config and history — to `<directory>/<key>.train<n>.pt`, n counting the calls in the block,
and a later call with the same n resumes from it: an interrupted experiment re-runs nothing but
the steps after its last evaluation, and ends with the same weights and history as an
uninterrupted one. A finished call resumes as finished (its final weights loaded), so a run that
trains several models in turn skips the finished ones. Outside such a block nothing is written. A
corrupt checkpoint is reported, moved aside (`.corrupt`) and the call starts over.

A step with a non-finite loss or gradient is skipped; MAX_NONFINITE_STEPS in a row stop the run
(train/guard.py).
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from routeformer.train.guard import NonFiniteGuard
from routeformer.train.optim import build_optimizer
from routeformer.train.schedule import Schedule
from routeformer.train.steps import StepResult, StepState, capture_state, restore_state, run_steps

MAX_NONFINITE_STEPS = 10  # a module constant, not a config field: checkpoints compare configs


@dataclass
class TaskTrainConfig:
    """A task run: its schedule (steps, batch size, learning rate, warm-up, clipping), AdamW's weight
    decay, an evaluation every `eval_every` steps (and at the end), and the seed of the weights and
    the batches."""
    schedule: Schedule = Schedule(steps=1000, batch_size=32, lr=1e-3, warmup_steps=50)
    weight_decay: float = 0.1
    eval_every: int = 100
    seed: int = 0


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


@contextmanager
def resumable_training(directory: str | Path, key: str) -> Iterator[None]:
    """Checkpoint and resume every `train_task` call inside the block (see the module docstring)."""
    token = _RESUMABLE.set(_Resumable(Path(directory), key))
    try:
        yield
    finally:
        _RESUMABLE.reset(token)


def training_checkpoints(directory: str | Path, key: str) -> list[Path]:
    """The checkpoint files `resumable_training(directory, key)` has written."""
    return sorted(Path(directory).glob(f"{glob.escape(key)}.train*.pt"))


def _resume(path: Path, config: TaskTrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
            generator: torch.Generator, guard: NonFiniteGuard) -> tuple[int, TaskHistory]:
    """(completed steps, history so far) from the checkpoint at `path`, restored in place."""
    state = load_checkpoint(path)
    if state["config"] != asdict(config):
        raise ValueError(f"checkpoint {str(path)!r} was written with another training config "
                         f"({state['config']}, now {asdict(config)}); delete it to start this run afresh")
    step = restore_state(state, model, optimizer, generator, guard)
    torch.set_rng_state(state["rng"]["torch"])
    return step, TaskHistory(**state["history"])


def _warn(message: str) -> None:
    print(f"routeformer: warning: {message}", file=sys.stderr, flush=True)


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
    """Train `model` on fresh batches `make_batch(batch_size, generator)`; `forward(model, inputs,
    labels)` returns a ModelOutput (default: `model(inputs, labels)`); `evaluate(model)` runs every
    `eval_every` steps and at the end, in eval mode."""
    schedule = config.schedule
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    forward = forward or (lambda m, inputs, labels: m(inputs, labels))
    optimizer = build_optimizer(model, lr=schedule.lr, weight_decay=config.weight_decay)
    history, state = TaskHistory(), StepState(0)
    resumable = _RESUMABLE.get()
    checkpoint = None if resumable is None else resumable.next_path()
    guard = NonFiniteGuard(MAX_NONFINITE_STEPS, warn=lambda step, message: _warn(message))
    if checkpoint is not None and checkpoint.exists():
        try:
            state.step, history = _resume(checkpoint, config, model, optimizer, generator, guard)
            if log:
                log(f"resumed from {checkpoint.name} after step {state.step}")
        except CheckpointError as error:  # nothing was restored: the call starts over
            os.replace(checkpoint, checkpoint.with_name(checkpoint.name + ".corrupt"))
            _warn(f"{error}; moved aside, this run starts over")
    began = time.perf_counter()

    def evaluate_now(result: StepResult) -> None:
        nonlocal began
        step = result.step
        if step % config.eval_every and step != schedule.steps:
            return
        history.train_seconds += time.perf_counter() - began
        model.eval()  # the step loop puts it back in train mode
        output = result.output
        record = {"step": step, "train_loss": output.loss.item(), "aux_loss": output.aux_loss.item(),
                  **evaluate(model)}
        history.evals.append(record)
        if log:
            log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
        if checkpoint is not None:  # after evaluating: the RNG state includes what it drew
            save_checkpoint(checkpoint, capture_state(step, model, optimizer, generator, guard,
                                                      config=asdict(config), history=asdict(history)))
        began = time.perf_counter()

    run_steps(model, optimizer, schedule, guard, state,
              lambda: (*make_batch(schedule.batch_size, generator), {}),
              lambda inputs, labels, extra: forward(model, inputs, labels),
              on_step_end=evaluate_now)
    history.final = history.evals[-1]
    return history
