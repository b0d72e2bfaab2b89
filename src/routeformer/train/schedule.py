"""How a stretch of training runs (`Schedule`) and its learning rate: linear warmup, then cosine decay
to lr · min_lr_ratio.

`Schedule` is the one place a training config states its steps, batch size, learning rate and
warm-up: `routeformer train`'s `train` section (train/config.py, where they stay flat YAML keys),
a task run (train/task_loop.py's TaskTrainConfig), a task of a compare budget and each of its
curriculum stages (runner/setups.py's TaskSetup and Stage) and a recall run of the meta-tokens
experiments (experiments/recall_runs.py) each hold one; the loop (train/steps.py) reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """`steps` updates on batches of `batch_size`; the learning rate rises linearly to `lr` over the
    first `warmup_steps`, then falls along a cosine to lr · `min_lr_ratio` at `steps`; gradients are
    clipped to norm `grad_clip` (0: no clipping; the norm is still measured, for the guard and the
    logs)."""
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def rate(self, step: int) -> float:
        """The learning rate of the update that follows `step` completed steps."""
        return learning_rate(step, lr=self.lr, warmup_steps=self.warmup_steps, total_steps=self.steps,
                             min_lr_ratio=self.min_lr_ratio)


def learning_rate(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
