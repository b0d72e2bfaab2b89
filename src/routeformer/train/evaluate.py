"""Evaluation of a language model: loss (nats/char), bits per character, perplexity."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from routeformer.data.batches import sequential_batches
from routeformer.models.heads import CausalLM


@torch.no_grad()
def evaluate_lm(
    model: CausalLM, ids: Tensor, *, seq_len: int, batch_size: int, max_tokens: int | None = None
) -> dict[str, float]:
    """Mean next-token loss over non-overlapping windows of `ids` (at most `max_tokens`)."""
    was_training = model.training
    model.eval()
    total_loss, total_tokens, flops = 0.0, 0, 0.0
    for inputs, labels in sequential_batches(ids, batch_size, seq_len, max_tokens):
        result = model(inputs, labels)
        total_loss += result.loss.item() * labels.numel()
        total_tokens += labels.numel()
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
