"""Learning-rate schedule: linear warmup, then cosine decay to lr · min_lr_ratio."""

from __future__ import annotations

import math


def learning_rate(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
