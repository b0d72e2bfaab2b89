"""Batches of (inputs, next-token labels) from a 1-D tensor of token ids."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

# The label of a position whose prediction takes no loss (PyTorch's cross_entropy default). Defined
# here, the lowest layer that writes such labels; models, tasks and training import it.
IGNORE_INDEX = -100


def random_batch(
    ids: Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """`batch_size` random windows: inputs ids[s : s+T], labels ids[s+1 : s+T+1]."""
    if len(ids) < seq_len + 1:
        raise ValueError(f"the text has {len(ids)} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
    starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = ids[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


def sequential_batches(
    ids: Tensor, batch_size: int, seq_len: int, max_tokens: int | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """Non-overlapping windows covering the text in order (for evaluation), at most `max_tokens`."""
    usable = (len(ids) - 1) // seq_len * seq_len
    if max_tokens is not None:
        usable = min(usable, max(seq_len, max_tokens // seq_len * seq_len))
    if usable < seq_len:
        raise ValueError(f"the text has {len(ids)} tokens; seq_len={seq_len} needs at least {seq_len + 1}")
    inputs = ids[:usable].view(-1, seq_len)
    labels = ids[1 : usable + 1].view(-1, seq_len)
    for start in range(0, len(inputs), batch_size):
        yield inputs[start : start + batch_size], labels[start : start + batch_size]
