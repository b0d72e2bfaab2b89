"""The Task contract every evaluation in routeformer goes through (Zoology's shape).

A task is a seeded generator plus its metric:

    task.batch(batch_size, generator, split="train") -> (inputs [B, T] long, labels [B, T] long)

(the training loop draws `task.training_batch(batch_size, generator)`: the same plus the extra
keyword arguments of the model's forward, {} unless the task's batches carry more)

`labels[b, t]` is the token the model must predict *at* position t (already shifted for causal
tasks), -100 where nothing is asked. Non-causal tasks (ListOps) ask at a position the whole
sequence can be read from. `task.pad_id` (or None) marks padding: `mask = inputs != pad_id`.

Splits are disjoint **by construction**: every generated sequence is assigned to exactly one split
by a fixed hash of its tokens (`splits.split_of`), and `batch` keeps only sequences of the split it
is asked for, so a validation or test sequence can never be drawn for training whatever the seeds.

`chance` is the accuracy of the best input-blind guess; `baselines()` measures, on a fixed sample
of the test split, the strongest shortcut rules we could devise: rules that ignore what the task
is meant to test (MQAR: the key; ListOps: the nesting; recall: the question). A model result means
something only above both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from routeformer.data.batches import IGNORE_INDEX
from routeformer.tasks.splits import SPLITS, check_split, keep_split

BASELINE_SEQUENCES = 2048  # the fixed sample every baseline is measured on
BASELINE_SEED = 12345

# A shortcut rule: (inputs [N, T], labels [N, T]) -> predictions [N, T] (read where labels >= 0).
Rule = Callable[[Tensor, Tensor], Tensor]


def check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
        raise ValueError(f"batch_size must be a non-negative integer; got {batch_size!r}")


class Task(ABC):
    """Base class; subclasses set the attributes below and implement `generate` and `rules`."""

    name: str = "task"
    vocab_size: int
    seq_len: int
    causal: bool = True
    pad_id: int | None = None
    metric: str = "accuracy"  # what `score` returns; higher is better
    higher_is_better: bool = True

    # -- what a subclass implements ----------------------------------------------------------
    @abstractmethod
    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """`count` fresh sequences of any split: (inputs [count, T], labels [count, T])."""

    @property
    @abstractmethod
    def chance(self) -> float:
        """Accuracy of the best input-blind guess."""

    def rules(self) -> dict[str, Rule]:
        """The shortcut rules whose accuracy `baselines()` reports."""
        return {}

    def options(self) -> dict[str, Any]:
        """The knobs this task was built with (for reports and `list_tasks`)."""
        return {}

    # -- shared machinery --------------------------------------------------------------------
    def batch(
        self, batch_size: int, generator: torch.Generator, split: str = "train",
    ) -> tuple[Tensor, Tensor]:
        """`batch_size` sequences of `split` ("train", "validation" or "test")."""
        check_batch_size(batch_size)
        check_split(split)
        inputs, labels = [], []
        have = 0
        while have < batch_size:
            # Oversample so one round usually suffices (train keeps ~80%, the others ~10%).
            wanted = batch_size - have
            draw = max(8, int(wanted * (1.3 if split == "train" else 11)))
            candidate_inputs, candidate_labels = self.generate(draw, generator)
            keep = keep_split(candidate_inputs, split)
            inputs.append(candidate_inputs[keep][:wanted])
            labels.append(candidate_labels[keep][:wanted])
            have += inputs[-1].shape[0]
        if not inputs:
            empty = torch.empty(0, self.seq_len, dtype=torch.long)
            return empty, empty.clone()
        return torch.cat(inputs), torch.cat(labels)

    def training_batch(
        self, batch_size: int, generator: torch.Generator,
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """A training batch and the extra keyword arguments the model's forward takes with it:
        `batch(batch_size, generator, "train")` and {} (a task whose training batches carry more, such
        as task lm's packed document ids, returns them here)."""
        inputs, labels = self.batch(batch_size, generator, "train")
        return inputs, labels, {}

    def mask(self, inputs: Tensor) -> Tensor | None:
        """Key-padding mask (True = real token) for `inputs`, or None when nothing is padded."""
        if self.pad_id is None:
            return None
        mask = inputs != self.pad_id
        return None if bool(mask.all()) else mask

    def fixed_sample(self, split: str, sequences: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """The same `sequences` sequences of `split` on every call (evaluation sets)."""
        offset = {name: index for index, name in enumerate(SPLITS)}[check_split(split)]
        return self.batch(sequences, torch.Generator().manual_seed(1_000_003 * seed + offset), split)

    def score(self, predictions: Tensor, labels: Tensor) -> float:
        """Accuracy of `predictions` [N, T] (read where labels >= 0)."""
        asked = labels != IGNORE_INDEX
        total = int(asked.sum())
        if total == 0:
            raise ValueError("score: the labels ask nothing (every label is -100)")
        return float((predictions[asked] == labels[asked]).sum()) / total

    def baselines(self, sequences: int = BASELINE_SEQUENCES) -> dict[str, float]:
        """Accuracy of each shortcut rule on a fixed sample of the test split (measured, not stated)."""
        inputs, labels = self.fixed_sample("test", sequences, seed=BASELINE_SEED)
        return {name: self.score(rule(inputs, labels), labels) for name, rule in self.rules().items()}

    def floor(self) -> float:
        """The number a model must beat: max(chance, every baseline)."""
        return max([self.chance, *self.baselines().values()])

    def describe(self) -> str:
        settings = ", ".join(f"{key}={value}" for key, value in self.options().items())
        return f"{self.name}({settings})"

    def __repr__(self) -> str:
        return self.describe()
