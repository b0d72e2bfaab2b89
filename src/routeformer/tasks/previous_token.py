"""Previous-token copying: uniform random tokens; at position t the label is the token at t - offset.

A pure test of *positional* routing: the answer is always `offset` keys back, so a mechanism that
cannot prefer nearby keys (a top-k router blind to position) fails it while full attention with
rotary positions solves it in one layer. Labels start at position `offset`.

`chance` is 1/V; the shortcut rule "repeat the current token" scores about 1/V too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive
from routeformer.tasks.base import IGNORE_INDEX, Rule, Task
from routeformer.tasks.registry import register_task


@register_task("previous_token")
class PreviousToken(Task):
    causal = True

    def __init__(self, seq_len: int = 64, vocab_size: int = 32, offset: int = 1) -> None:
        for name, value in (("seq_len", seq_len), ("vocab_size", vocab_size), ("offset", offset)):
            check_positive(name, value)
        if offset >= seq_len:
            raise ValueError(f"offset must be < seq_len ({seq_len}); got {offset}")
        self.seq_len, self.vocab_size, self.offset, self.name = seq_len, vocab_size, offset, "previous_token"

    def options(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "vocab_size": self.vocab_size, "offset": self.offset}

    @property
    def chance(self) -> float:
        return 1.0 / self.vocab_size

    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        inputs = torch.randint(0, self.vocab_size, (count, self.seq_len), generator=generator)
        labels = torch.full_like(inputs, IGNORE_INDEX)
        labels[:, self.offset:] = inputs[:, :-self.offset]
        return inputs, labels

    def rules(self) -> dict[str, Rule]:
        return {"repeat the current token": lambda inputs, labels: inputs}
