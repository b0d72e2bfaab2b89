"""The recall tasks of "Language Modeling with Learned Meta-Tokens" (Shah et al., 2025) as tasks:
`list_recall`, `segment_counting`, `parity`, `copying` (formats in `tasks/recall_sequences.py`).

No question is asked twice in a sequence (the earlier version drew questions with replacement, so
a copy rule answered repeated questions from the visible earlier answer: 0.66 on parity).

`chance` is the best input-blind guess (list recall and copying 1/64; counting the mode of the
Binomial(n, 1/4) count; parity 1/2). The shortcut rules ignore what is asked: which segment (its
key), or, for copying, which segment is marked; one more repeats the previous answer.

`recall_split_batch(spec, count, generator, split)` draws the sequences of any `RecallTask` spec
(meta-tokens included) from one hash split, as the registered tasks do.
"""

from __future__ import annotations

from math import comb
from typing import Any

import torch
from torch import Tensor

from routeformer.tasks.base import IGNORE_INDEX, Rule, Task
from routeformer.tasks.recall_sequences import (
    COUNTING_SYMBOLS,
    ITEM_BASE,
    ITEMS,
    NUMBER_BASE,
    VOCAB_SIZE,
    RecallTask,
    recall_batch,
)
from routeformer.tasks.registry import register_task


class _RecallTaskBase(Task):
    causal = True
    task_name = "list_recall"

    def __init__(
        self, segments: int = 8, segment_length: int = 4, queries: int = 4, meta: bool = False,
    ) -> None:
        self._use(RecallTask(self.task_name, segments=segments, segment_length=segment_length,
                             queries=queries, meta=meta))

    @classmethod
    def from_spec(cls, spec: RecallTask) -> _RecallTaskBase:
        """The task of any `RecallTask` spec, even one the constructor's options cannot express
        (copying with several queries)."""
        task = cls.__new__(cls)
        task._use(spec)
        return task

    def _use(self, spec: RecallTask) -> None:
        self.spec = spec
        self.name, self.vocab_size, self.seq_len = self.task_name, VOCAB_SIZE, spec.seq_len

    def options(self) -> dict[str, Any]:
        spec = self.spec
        return {"segments": spec.segments, "segment_length": spec.segment_length, "queries": spec.queries,
                "meta": spec.meta}

    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        if count == 0:
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        return recall_batch(self.spec, count, generator)

    # -- the layout, for the rules ---------------------------------------------------------
    @property
    def segment_span(self) -> int:
        """Tokens per segment: key (not for copying), brackets, items, the meta-token if any."""
        spec = self.spec
        return spec.segment_length + 2 + int(spec.meta) + int(self.task_name != "copying")

    def segment_items(self, inputs: Tensor) -> Tensor:
        """[N, segments, n]: the items of every segment."""
        span, n = self.segment_span, self.spec.segment_length
        first = 2 if self.task_name != "copying" else 1  # after "K [" or "["
        starts = torch.arange(self.spec.segments) * span + first
        index = starts[:, None] + torch.arange(n)
        return inputs[:, index]

    def rules(self) -> dict[str, Rule]:
        def previous_answer(inputs: Tensor, labels: Tensor) -> Tensor:
            # The old leak: repeat the latest answer given so far (inputs hold earlier answers).
            asked = labels != IGNORE_INDEX
            answer_tokens = torch.zeros_like(inputs)
            answer_tokens[:, 1:] = torch.where(asked[:, :-1], inputs[:, 1:], 0)
            positions = torch.where(answer_tokens > 0, torch.arange(inputs.shape[1]), -1)
            seen = torch.cummax(positions, dim=1).values
            return inputs.gather(1, seen.clamp_min(0)).masked_fill(seen < 0, self._fallback_guess())

        return {"repeat the previous answer": previous_answer}

    def _fallback_guess(self) -> int:
        return ITEM_BASE


@register_task("list_recall")
class ListRecall(_RecallTaskBase):
    task_name = "list_recall"

    @property
    def chance(self) -> float:
        return 1.0 / ITEMS

    def rules(self) -> dict[str, Rule]:
        def index_of_last_segment(inputs: Tensor, labels: Tensor) -> Tensor:
            # "? K j =": the index token sits one before the position that is asked
            items = self.segment_items(inputs)[:, -1]  # [N, n]
            index = (inputs.roll(1, dims=1) - NUMBER_BASE).clamp(0, self.spec.segment_length - 1)
            return items.gather(1, index)

        return {**super().rules(), "item j of the last segment": index_of_last_segment}


@register_task("segment_counting")
class SegmentCounting(_RecallTaskBase):
    task_name = "segment_counting"

    @property
    def chance(self) -> float:
        n = self.spec.segment_length  # the mode of Binomial(n, 1/4)
        return max(comb(n, c) * 0.25**c * 0.75 ** (n - c) for c in range(n + 1))

    def _fallback_guess(self) -> int:
        return NUMBER_BASE + (self.spec.segment_length + 1) // COUNTING_SYMBOLS

    def rules(self) -> dict[str, Rule]:
        def mean_count_everywhere(inputs: Tensor, labels: Tensor) -> Tensor:
            # counts s over all segments, divides by the number of segments: ignores which one is asked
            items = self.segment_items(inputs).flatten(1)  # [N, S·n]
            symbol = inputs.roll(1, dims=1)  # "? K s =": s is one before the asked position
            total = (items[:, None, :] == symbol[:, :, None]).sum(-1).float()
            return NUMBER_BASE + (total / self.spec.segments).round().long()

        def count_in_last_segment(inputs: Tensor, labels: Tensor) -> Tensor:
            items = self.segment_items(inputs)[:, -1]  # [N, n]
            symbol = inputs.roll(1, dims=1)
            return NUMBER_BASE + (items[:, None, :] == symbol[:, :, None]).sum(-1)

        return {**super().rules(), "mean count over all segments": mean_count_everywhere,
                "count in the last segment": count_in_last_segment}


@register_task("parity")
class Parity(_RecallTaskBase):
    task_name = "parity"

    @property
    def chance(self) -> float:
        return 0.5

    def _fallback_guess(self) -> int:
        return NUMBER_BASE

    def rules(self) -> dict[str, Rule]:
        def parity_of_last_segment(inputs: Tensor, labels: Tensor) -> Tensor:
            bits = self.segment_items(inputs)[:, -1] - NUMBER_BASE
            return (NUMBER_BASE + bits.sum(-1) % 2)[:, None].expand_as(inputs)

        def parity_of_everything(inputs: Tensor, labels: Tensor) -> Tensor:
            bits = self.segment_items(inputs).flatten(1) - NUMBER_BASE
            return (NUMBER_BASE + bits.sum(-1) % 2)[:, None].expand_as(inputs)

        return {**super().rules(), "parity of the last segment": parity_of_last_segment,
                "parity of all segments": parity_of_everything}


@register_task("copying")
class Copying(_RecallTaskBase):
    task_name = "copying"

    def __init__(
        self, segments: int = 8, segment_length: int = 4, queries: int = 1, meta: bool = False,
    ) -> None:
        if queries != 1:
            raise ValueError(f"copying asks one question (copy the marked segment); queries must be 1, "
                             f"got {queries!r}")
        super().__init__(segments, segment_length, queries, meta)

    @property
    def chance(self) -> float:
        return 1.0 / ITEMS

    def rules(self) -> dict[str, Rule]:
        def copy_segment(which: int) -> Rule:
            def rule(inputs: Tensor, labels: Tensor) -> Tensor:
                # the k-th answer token is the k-th item of the copied segment
                items = self.segment_items(inputs)[:, which]
                asked = labels != IGNORE_INDEX
                order = (asked.long().cumsum(1) - 1).clamp(0, self.spec.segment_length - 1)
                return items.gather(1, order)
            return rule

        return {"copy the last segment": copy_segment(-1), "copy the first segment": copy_segment(0)}


_TASK_CLASSES = {cls.task_name: cls for cls in (ListRecall, SegmentCounting, Parity, Copying)}


def recall_split_batch(spec: RecallTask, count: int, generator: torch.Generator,
                       split: str) -> tuple[Tensor, Tensor]:
    """`count` sequences of `spec` that belong to `split` ("train", "validation" or "test"; the
    hash splits of tasks/splits.py), drawn from `generator`."""
    return _TASK_CLASSES[spec.name].from_spec(spec).batch(count, generator, split)
