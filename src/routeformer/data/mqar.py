"""Multi-query associative recall (MQAR, Zoology-style), seeded.

Format of one sequence of length T with N key-value pairs and vocabulary V:

    positions 0 .. 2N-1     k_1 v_1 k_2 v_2 ... k_N v_N       (context: N distinct keys)
    positions 2N .. T-1     filler 0, with the N keys asked again in random order, each as a
                            pair "k_i v_i" at a random even offset (non-overlapping)

Keys are drawn from [1, V/2), values from [V/2, V); token 0 is the filler; id V is reserved for
the meta-token `_PAUSE_` (`MQARConfig.pause_id`; a model that reads it needs V + 1 embeddings).
Labels are -100 everywhere except at each query key, whose label is its value (the next token): the model must
find the key's earlier occurrence and copy what followed it. Zoology spaces its queries with a
power law; ours are uniform over the free slots, which makes the average distance to the
context larger, i.e. the task no easier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from routeformer.models.heads import IGNORE_INDEX
from routeformer.ops._checks import check_positive

FILLER = 0


@dataclass(frozen=True)
class MQARConfig:
    seq_len: int = 256
    pairs: int = 16
    vocab_size: int = 8192

    @property
    def pause_id(self) -> int:
        """The reserved meta-token id (never generated)."""
        return self.vocab_size

    def __post_init__(self) -> None:
        check_positive("seq_len", self.seq_len)
        check_positive("pairs", self.pairs)
        check_positive("vocab_size", self.vocab_size)
        if self.seq_len < 4 * self.pairs:
            raise ValueError(f"seq_len must be >= 4·pairs = {4 * self.pairs} (context + queries); "
                             f"got {self.seq_len}")
        if self.vocab_size // 2 - 1 < self.pairs:
            raise ValueError(f"vocab_size must give at least `pairs` distinct keys; got {self.vocab_size}")


def mqar_batch(config: MQARConfig, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(inputs [B, T] long, labels [B, T] long) as in the module docstring."""
    check_positive("batch_size", batch_size)
    pairs, length, half = config.pairs, config.seq_len, config.vocab_size // 2
    keys = torch.rand(batch_size, half - 1, generator=generator).argsort(dim=1)[:, :pairs] + 1
    values = torch.randint(half, config.vocab_size, (batch_size, pairs), generator=generator)
    inputs = torch.full((batch_size, length), FILLER, dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2] = keys, values
    free_slots = (length - 2 * pairs) // 2
    slots = torch.rand(batch_size, free_slots, generator=generator).argsort(dim=1)[:, :pairs]
    query_pos = 2 * pairs + 2 * slots  # [B, N]: where the i-th key is asked again
    order = torch.rand(batch_size, pairs, generator=generator).argsort(dim=1)
    asked_keys, asked_values = keys.gather(1, order), values.gather(1, order)
    inputs.scatter_(1, query_pos, asked_keys)
    inputs.scatter_(1, query_pos + 1, asked_values)
    labels.scatter_(1, query_pos, asked_values)
    return inputs, labels
