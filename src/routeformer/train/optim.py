"""The optimizer of every training run: AdamW with weight decay on matrices only."""

from __future__ import annotations

from typing import Any

import torch


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups: decay on matrices only (not on norms, biases or embeddings)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        is_matrix = parameter.dim() >= 2 and "embedding" not in name
        (decay if is_matrix else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (see `weight_decay_groups`)."""
    return torch.optim.AdamW(weight_decay_groups(model, weight_decay), lr=lr, betas=betas)


def apply_optimizer_settings(optimizer: torch.optim.AdamW, *, weight_decay: float,
                             betas: tuple[float, float]) -> None:
    """Set betas and weight decay on an optimizer restored from a checkpoint (its saved groups
    carry the old values; a resumed run with new ones must use them)."""
    decay, no_decay = optimizer.param_groups
    decay["weight_decay"], no_decay["weight_decay"] = weight_decay, 0.0
    for group in optimizer.param_groups:
        group["betas"] = betas
