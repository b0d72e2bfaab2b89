"""The training driver every run goes through: the task loop (train/task_loop.py: `routeformer
train`, compare, the experiments, sparsify's stages) builds a `Driver` around its model and calls
`Driver.train` with its batches.

A driver owns what a run's steps need beside the model: AdamW (train/optim.py: weight decay on
matrices only), the batch generator (a `torch.Generator` seeded by the run's seed, so runs with
one seed see the same batches), the non-finite guard (train/guard.py: under several processes a
step is skipped on all of them when it is non-finite on any), the step position, the restore from
a checkpoint (weights, optimizer, gradient scaler, batch generator, guard counts and this process's
torch RNG) and its counterpart `capture`, the per-process seeding and the DistributedDataParallel
wrapper under several processes (train/distributed.py), and the step loop itself
(`train.steps.run_steps`). Callers keep what differs: where batches come from, what they evaluate
and log, and where checkpoints live.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.train.distributed import (
    DistributedContext,
    mean_over_ranks,
    needs_unused_parameter_search,
    restore_rank_rng,
)
from routeformer.train.guard import NonFiniteGuard
from routeformer.train.interrupts import DeferredInterrupts
from routeformer.train.optim import apply_optimizer_settings, build_optimizer
from routeformer.train.precision import autocast
from routeformer.train.schedule import Schedule
from routeformer.train.steps import StepResult, StepState, capture_state, restore_state, run_steps


def warn(message: str) -> None:
    """A warning line on stderr (`routeformer: warning: ...`), flushed at once."""
    print(f"routeformer: warning: {message}", file=sys.stderr, flush=True)


def needs_unused_search(model: nn.Module) -> bool:
    """DDP's find_unused_parameters for `model`: from its layers' mechanisms when it states them
    (a `config.layer_attention()`), else on (correct for every model)."""
    layers = getattr(getattr(model, "config", None), "layer_attention", None)
    return needs_unused_parameter_search(layers()) if callable(layers) else True


class Driver:
    """The optimizer, batch generator, guard and position of one run of `model` (module docstring).

    Args:
        model: the module to train, on `device`.
        schedule: steps, batch size, learning rate, warm-up, cosine floor and clipping.
        seed: seeds torch's RNG (after the caller built the model, so a run's dropout masks and
            routing samples do not depend on how its weights were initialised; process r > 0 of
            several draws from `seed + r` unless restored), then the batch generator.
        weight_decay, betas: AdamW's.
        max_nonfinite: non-finite steps in a row that stop the run (train/guard.py).
        on_skip: `on_skip(step, message)` hears each skipped step (default: a warning on stderr).
        context: the processes the run trains on (default: this one alone).
        scaler: the gradient scaler of an fp16 run (None: none; fp32 and bf16).
    """

    def __init__(self, model: nn.Module, *, schedule: Schedule, seed: int, weight_decay: float,
                 betas: tuple[float, float], max_nonfinite: int, device: torch.device,
                 on_skip: Callable[[int, str], None] | None = None,
                 context: DistributedContext | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.model, self.schedule, self.seed, self.device = model, schedule, seed, device
        self.context = context or DistributedContext()
        self.weight_decay, self.betas, self.scaler = weight_decay, betas, scaler
        torch.manual_seed(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizer = build_optimizer(model, lr=schedule.lr, weight_decay=weight_decay, betas=betas)
        self.guard = NonFiniteGuard(max_nonfinite, warn=on_skip or (lambda step, message: warn(message)),
                                    all_ranks=lambda flag: mean_over_ranks(flag, self.context))
        self.position = StepState(0)
        self.restored = False

    @property
    def step(self) -> int:
        """Completed steps (a restored run's count included)."""
        return self.position.step

    def restore(self, state: dict[str, Any]) -> str | None:
        """Load a checkpoint's `state` (what `capture` saved) into the run; the optimizer takes this
        run's weight decay and betas. Returns a warning when this process's torch RNG had no saved
        state and was reseeded (train/distributed.py), else None."""
        self.position.step = restore_state(state, self.model, self.optimizer, self.generator, self.guard,
                                           self.scaler)
        apply_optimizer_settings(self.optimizer, weight_decay=self.weight_decay, betas=self.betas)
        self.restored = True
        return restore_rank_rng(state["rng"], self.context, self.device, self.seed, self.position.step)

    def capture(self, step: int, **extra: Any) -> dict[str, Any]:
        """The checkpoint state at `step` (`train.steps.capture_state`, the scaler's with an fp16
        scaler), plus `extra`."""
        if self.scaler is not None:
            extra = {"scaler": self.scaler.state_dict(), **extra}
        return capture_state(step, self.model, self.optimizer, self.generator, self.guard, **extra)

    def train(self, next_batch: Callable[[], tuple[Tensor, Tensor, dict[str, Tensor]]],
              forward: Callable[[nn.Module, Tensor, Tensor, dict[str, Tensor]], Any], *,
              precision: str = "fp32", on_update: Callable[[StepResult], None] | None = None,
              on_step_end: Callable[[StepResult], None] | None = None,
              interrupts: DeferredInterrupts | None = None) -> None:
        """Train from the current step to `schedule.steps` (`train.steps.run_steps`; its hooks as
        there). `forward(trained, inputs, labels, extra)` gets the model as trained: the
        DistributedDataParallel wrapper under several processes, the model itself otherwise.
        `precision` sets the forward's autocast (train/precision.py)."""
        context, trained = self.context, self.model
        if context.rank and not self.restored:  # processes other than 0 draw their own samples
            torch.manual_seed(self.seed + context.rank)
        if context.enabled:
            from torch.nn.parallel import DistributedDataParallel

            # Routed layers may leave a parameter without gradient in a step (an expert no token chose).
            search = needs_unused_search(self.model)
            trained = DistributedDataParallel(self.model, find_unused_parameters=search)
        run_steps(self.model, self.optimizer, self.schedule, self.guard, self.position, next_batch,
                  lambda inputs, labels, extra: forward(trained, inputs, labels, extra), scaler=self.scaler,
                  autocast=lambda: autocast(precision, self.device), on_update=on_update,
                  on_step_end=on_step_end, interrupts=interrupts)
