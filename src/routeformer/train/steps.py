"""The one training loop of routeformer: `run_steps` is the only function that steps an optimizer.

Every training run (train/task_loop.py: `routeformer train`, compare, the paper experiments) goes
through the driver that calls this loop (train/driver.py), its optimizer (train/optim.py), schedule
(train/schedule.py), non-finite guard (train/guard.py) and checkpoint state (`capture_state` /
`restore_state`), so a fix to any of them reaches every run.

One step, in this order (the order is part of the contract: a resumed or re-run training repeats
it bit for bit): set the scheduled learning rate, put the model in train mode (an evaluation may
have left it in eval mode), draw the batch, forward (under the precision's autocast), zero the
gradients, backward (through the gradient scaler, a pass-through unless fp16), unscale, clip,
count the step, ask the guard, then apply the update (`on_update` hears of it) or skip it. Every
step ends with `on_step_end`, where callers evaluate and checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.train.guard import NonFiniteGuard
from routeformer.train.interrupts import DeferredInterrupts
from routeformer.train.schedule import Schedule


@dataclass
class StepState:
    """Where the loop stands: `step` completed steps; `at_boundary` is False while a step is under
    way (a state caught then is not one a checkpoint may hold)."""
    step: int
    at_boundary: bool = True


@dataclass
class StepResult:
    step: int  # completed steps, this one included
    output: Any  # what `forward` returned (a ModelOutput: total_loss, loss, aux_loss, stats)
    rate: float
    grad_norm: Tensor
    inputs: Tensor


def run_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Schedule, guard: NonFiniteGuard,
    state: StepState, next_batch: Callable[[], tuple[Tensor, Tensor, dict[str, Tensor]]],
    forward: Callable[[Tensor, Tensor, dict[str, Tensor]], Any], *,
    scaler: torch.amp.GradScaler | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    on_update: Callable[[StepResult], None] | None = None,
    on_step_end: Callable[[StepResult], None] | None = None,
    interrupts: DeferredInterrupts | None = None,
) -> None:
    """Train from `state.step` to `schedule.steps` (see the module docstring for one step).

    `next_batch()` -> (inputs, labels, extra forward arguments); `forward(inputs, labels, extra)`
    -> an output with `total_loss`. `scaler` None: a disabled one (fp32 and bf16). With
    `interrupts`, a Ctrl-C raises KeyboardInterrupt at a step boundary (train/interrupts.py),
    including after the last step. `state` is updated in place, so a caller that catches an
    interrupt knows where the run stopped."""
    scaler = scaler if scaler is not None else torch.amp.GradScaler("cpu", enabled=False)
    scaled = scaler.is_enabled()  # fp16: overflowing gradients are the scaler's to skip
    clip = schedule.grad_clip if schedule.grad_clip > 0 else math.inf
    while state.step < schedule.steps:
        if interrupts is not None:
            interrupts.check()  # a Ctrl-C stops here, between steps
        state.at_boundary = False
        rate = schedule.rate(state.step)
        for group in optimizer.param_groups:
            group["lr"] = rate
        model.train()
        inputs, labels, extra = next_batch()
        with autocast():
            output = forward(inputs, labels, extra)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(output.total_loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        state.step += 1
        result = StepResult(state.step, output, rate, grad_norm, inputs)
        if guard.allows(state.step, output.total_loss, 0.0 if scaled else grad_norm):
            scaler.step(optimizer)
            scaler.update()
            if on_update is not None:
                on_update(result)
        elif scaled:
            scaler.update()
        if on_step_end is not None:  # evaluations and checkpoints
            on_step_end(result)
        state.at_boundary = True
    if interrupts is not None:
        interrupts.check()  # a Ctrl-C in the last step stops before what follows training


def capture_state(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Generator,
                  guard: NonFiniteGuard, **extra: Any) -> dict[str, Any]:
    """The checkpoint state every run writes: weights, optimizer, completed steps, the batch
    generator's and torch's RNG states, the guard's counts, plus `extra` (config, history, ...).
    Saved after a step's evaluation, so the RNG states include what the evaluation drew."""
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": {"data": data.get_state(), "torch": torch.get_rng_state()},
            "guard": {"skipped": guard.skipped, "consecutive": guard.consecutive}, **extra}


def restore_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                  data: torch.Generator, guard: NonFiniteGuard,
                  scaler: torch.amp.GradScaler | None = None) -> int:
    """Load what `capture_state` saved into the run's objects; returns the completed steps.
    Torch's own RNG is the caller's to restore (one state per process under torchrun)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    data.set_state(state["rng"]["data"] if "data" in state["rng"] else state["rng"]["batches"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if "guard" in state:  # skipped updates so far, and in a row (the divergence limit counts on)
        guard.skipped, guard.consecutive = state["guard"]["skipped"], state["guard"]["consecutive"]
    return state["step"]
