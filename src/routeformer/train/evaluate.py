"""Evaluation of a language model: loss (nats/char), bits per character, perplexity."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from routeformer.data.batches import sequential_batches
from routeformer.models.heads import IGNORE_INDEX, CausalLM
from routeformer.tasks.meta_tokens import inject_into_batch, real_tokens_per_window


@torch.no_grad()
def evaluate_lm(
    model: CausalLM, ids: Tensor, *, seq_len: int, batch_size: int, max_tokens: int | None = None,
    meta_density: float = 0.0, meta_id: int | None = None,
) -> dict[str, float]:
    """Mean next-token loss over non-overlapping windows of `ids` (at most `max_tokens`).

    With `meta_density` > 0, each window of seq_len slots holds meta-tokens `meta_id` at seeded
    positions (the same on every call) and the loss covers the real tokens only.
    """
    was_training = model.training
    model.eval()
    total_loss, total_tokens, flops = 0.0, 0, 0.0
    injection = torch.Generator().manual_seed(0)
    real_len = real_tokens_per_window(seq_len, meta_density)
    for inputs, labels in sequential_batches(ids, batch_size, real_len, max_tokens):
        if meta_density > 0:
            inputs, labels = inject_into_batch(inputs, labels, seq_len, meta_id=meta_id, density=meta_density,
                                               generator=injection)
        device = model.lm_head.weight.device
        result = model(inputs.to(device), labels.to(device))
        counted = int((labels != IGNORE_INDEX).sum())  # labels stay on the CPU
        total_loss += result.loss.item() * counted
        total_tokens += counted
        flops += sum(float(layer.get("flops", 0.0)) for layer in result.stats)
    model.train(was_training)
    loss = total_loss / total_tokens
    return {
        "loss": loss,
        "bpc": loss / math.log(2),
        "ppl": math.exp(loss),
        "tokens": total_tokens,
        "attention_flops_per_token": flops / total_tokens,
    }
