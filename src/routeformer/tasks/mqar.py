"""Multi-query associative recall as Zoology defines it (Arora et al. 2023, "Zoology: Measuring
and Improving Recall in Efficient Language Models", section 3 and its `multiquery_ar` generator).

One sequence of length T with N pairs and vocabulary V:

    positions 0 .. 2N-1   k_1 v_1 k_2 v_2 ... k_N v_N     context: N distinct keys, N distinct values
    positions 2N .. T-1   filler 0; each of the N keys asked once, at an even offset, in random
                          order, and followed by filler — never by its answer

Keys come from [1, V/2), values from [V/2, V) drawn *without* replacement, token 0 is the filler.
The label at a query key is that key's value; every other label is -100. Query offsets are uniform
over the free slots (`spacing="uniform"`) or Zoology's power law (`spacing="power"`, p(slot g) ∝
g^(a-1) with a = 0.01), which puts most queries close to the context.

Since the answers never appear after the context and the questions come in a uniformly random
order, any rule that ignores the asked key scores 1/N in expectation; `baselines()` measures three
such rules on the test split. `chance` (input-blind) is 1 / (V - V/2).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive
from routeformer.tasks.base import IGNORE_INDEX, Rule, Task
from routeformer.tasks.registry import register_task

FILLER = 0
SPACINGS = ("uniform", "power")
POWER_A = 0.01  # Zoology's default exponent


def distinct_draws(count: int, k: int, low: int, high: int, generator: torch.Generator) -> Tensor:
    """[count, k] integers from [low, high), distinct within each row, uniformly random in order."""
    span = high - low
    if span <= 8 * k:  # small range: a random permutation per row
        return torch.rand(count, span, generator=generator).argsort(dim=1)[:, :k] + low
    # Large range: draw with replacement and redraw the (few) rows that repeat a number; O(count·k)
    # instead of O(count·span).
    draws = torch.randint(low, high, (count, k), generator=generator)
    while True:
        ordered = draws.sort(dim=1).values
        repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if not bool(repeats.any()):
            return draws
        draws[repeats] = torch.randint(low, high, (int(repeats.sum()), k), generator=generator)


@register_task("mqar")
class MQAR(Task):
    causal = True

    def __init__(
        self, seq_len: int = 64, pairs: int = 4, vocab_size: int = 64, spacing: str = "uniform",
    ) -> None:
        for name, value in (("seq_len", seq_len), ("pairs", pairs), ("vocab_size", vocab_size)):
            check_positive(name, value)
        if seq_len < 4 * pairs:
            raise ValueError(f"seq_len must be >= 4 * pairs = {4 * pairs} (context + one slot per query); "
                             f"got {seq_len}")
        half = vocab_size // 2
        if half - 1 < pairs or vocab_size - half < pairs:
            raise ValueError(f"vocab_size must hold `pairs` distinct keys in [1, V/2) and values in "
                             f"[V/2, V): needs >= {2 * pairs + 2} for pairs={pairs}; got {vocab_size}")
        if spacing not in SPACINGS:
            raise ValueError(f"spacing must be one of {list(SPACINGS)}; got {spacing!r}")
        self.seq_len, self.pairs, self.vocab_size, self.spacing = seq_len, pairs, vocab_size, spacing
        self.name = "mqar"
        slots = (seq_len - 2 * pairs) // 2
        weights = torch.arange(1, slots + 1, dtype=torch.float64) ** (POWER_A - 1)
        self._slot_weights = (weights / weights.sum()).float() if spacing == "power" else None

    def options(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "pairs": self.pairs, "vocab_size": self.vocab_size,
                "spacing": self.spacing}

    @property
    def chance(self) -> float:
        return 1.0 / (self.vocab_size - self.vocab_size // 2)

    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        pairs, length, half = self.pairs, self.seq_len, self.vocab_size // 2
        keys = distinct_draws(count, pairs, 1, half, generator)
        values = distinct_draws(count, pairs, half, self.vocab_size, generator)
        inputs = torch.full((count, length), FILLER, dtype=torch.long)
        labels = torch.full((count, length), IGNORE_INDEX, dtype=torch.long)
        inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2] = keys, values
        free_slots = (length - 2 * pairs) // 2
        if self._slot_weights is None:
            slots = torch.rand(count, free_slots, generator=generator).argsort(dim=1)[:, :pairs]
        else:
            slots = torch.multinomial(self._slot_weights.expand(count, -1), pairs, generator=generator)
            # Without replacement, the likeliest (earliest) slots tend to be drawn first, so key i
            # would tend to be asked early — an order shortcut (Zoology's generator has it). Shuffle.
            shuffle = torch.rand(count, pairs, generator=generator).argsort(dim=1)
            slots = slots.gather(1, shuffle)
        query_positions = 2 * pairs + 2 * slots  # [count, N]: where the i-th key is asked
        inputs.scatter_(1, query_positions, keys)
        labels.scatter_(1, query_positions, values)
        return inputs, labels

    # -- shortcut rules: each ignores which key is asked ---------------------------------------
    def rules(self) -> dict[str, Rule]:
        pairs = self.pairs

        def context_values(inputs: Tensor) -> Tensor:
            return inputs[:, 1:2 * pairs:2]

        def first_value(inputs: Tensor, labels: Tensor) -> Tensor:
            return context_values(inputs)[:, :1].expand_as(inputs)

        def last_value(inputs: Tensor, labels: Tensor) -> Tensor:
            return context_values(inputs)[:, -1:].expand_as(inputs)

        def in_order(inputs: Tensor, labels: Tensor) -> Tensor:
            # the j-th question (by position) gets the j-th pair's value
            asked = labels != IGNORE_INDEX
            order = (asked.long().cumsum(1) - 1).clamp(0, pairs - 1)
            return context_values(inputs).gather(1, order)

        return {"first context value": first_value, "last context value": last_value,
                "j-th question -> j-th value": in_order}
