"""A short training loop for synthetic tasks (recall, counting, ...): AdamW, warmup + cosine,
clipping, periodic evaluation. Runs last minutes, so they restart rather than resume; experiments
resume at the granularity of finished runs (`experiments.report.cached_run`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from routeformer.train.loop import weight_decay_groups
from routeformer.train.schedule import learning_rate


@dataclass
class TaskTrainConfig:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    seed: int = 0


@dataclass
class TaskHistory:
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)


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
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    forward = forward or (lambda m, inputs, labels: m(inputs, labels))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, config.weight_decay), lr=config.lr)
    history = TaskHistory()
    began = time.perf_counter()
    for step in range(1, config.steps + 1):
        rate = learning_rate(step - 1, lr=config.lr, warmup_steps=config.warmup_steps,
                             total_steps=config.steps, min_lr_ratio=0.1)
        for group in optimizer.param_groups:
            group["lr"] = rate
        model.train()
        inputs, labels = make_batch(config.batch_size, generator)
        result = forward(model, inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        result.total_loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        if step % config.eval_every == 0 or step == config.steps:
            history.train_seconds += time.perf_counter() - began
            model.eval()  # the step loop puts it back in train mode
            record = {"step": step, "train_loss": result.loss.item(),
                      "aux_loss": result.aux_loss.item(), **evaluate(model)}
            history.evals.append(record)
            if log:
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in record.items()))
            began = time.perf_counter()
    history.final = history.evals[-1]
    return history
