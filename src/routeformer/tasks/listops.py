"""ListOps (Long Range Arena): our own generator of its published grammar, and the task built on it.

The grammar. A sequence is a nested expression in prefix form, e.g. `[MAX 2 9 [MIN 4 7 ] 0 ]`,
whose value (0-9) is the label. Operators: MAX, MIN, MED (the median, rounded down to an integer as
`int(numpy.median)` does), SM (sum mod 10). As in LRA's generator: a node below `max_depth`
becomes an operator with probability `operator_probability` (else a digit), an operator takes
2..`max_args` arguments, and trees are drawn until their token count lies in
[min_length, max_length] (LRA: depth <= 10, <= 10 arguments, 500..2000 tokens).
Token ids: 0 padding, 1-10 the digits 0-9, 11-14 the operators, 15 the closing bracket; 16 is
reserved for the meta-token `_PAUSE_` (never generated; a model that reads meta-tokens uses
VOCAB_SIZE_WITH_PAUSE). `pad_batch` right-pads examples with a bool mask (True = real token).

The task (`build_task("listops")`, bidirectional). A sequence is `?` followed by the expression,
right-padded to `seq_len`; the label at position 0 (the `?`) is the expression's value as a digit
token, every other label is -100. The model reads the whole sequence (non-causal) and answers at `?`.

Like LRA, the task is a fixed pool of expressions (`pool` of them, drawn once per process for
given options and cached), so batches cost an index and a copy, not a Python tree walk. Pool
entries are assigned to splits by the hash of their tokens (identical expressions always land in
the same split).

`chance` is the accuracy of the training pool's majority value; the shortcut rules ignore the
nesting ListOps is meant to test: the majority value given the outermost operator, and the
outermost operator applied to every digit (flat) or to its direct digit arguments only.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive
from routeformer.tasks.base import IGNORE_INDEX, Rule, Task, check_batch_size
from routeformer.tasks.registry import register_task
from routeformer.tasks.splits import SPLITS, keep_split

PAD = 0
OPERATORS = ("MAX", "MIN", "MED", "SM")
DIGIT_BASE = 1
OPERATOR_BASE = 11
CLOSE = 15
VOCAB_SIZE = 16
PAUSE = VOCAB_SIZE  # the meta-token `_PAUSE_` (tasks/meta_tokens.py)
VOCAB_SIZE_WITH_PAUSE = VOCAB_SIZE + 1
NUM_CLASSES = 10


@dataclass(frozen=True)
class ListOpsConfig:
    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    operator_probability: float = 0.25

    def __post_init__(self) -> None:
        for name in ("min_length", "max_length", "max_depth"):
            check_positive(name, getattr(self, name))
        if self.max_length < self.min_length:
            raise ValueError(f"max_length ({self.max_length}) must be >= min_length ({self.min_length})")
        if not isinstance(self.max_args, int) or self.max_args < 2:
            raise ValueError(f"max_args must be an integer >= 2; got {self.max_args!r}")
        if not 0.0 < self.operator_probability < 1.0:
            raise ValueError(f"operator_probability must be in (0, 1); got {self.operator_probability!r}")


def evaluate_tree(tree) -> int:
    """The value of a tree: an int leaf, or (operator, [subtrees])."""
    if isinstance(tree, int):
        return tree
    operator, children = tree
    values = sorted(evaluate_tree(child) for child in children)
    if operator == "MAX":
        return values[-1]
    if operator == "MIN":
        return values[0]
    if operator == "SM":
        return sum(values) % 10
    middle = len(values) // 2  # MED: numpy's median of the values, truncated to int
    return values[middle] if len(values) % 2 else int((values[middle - 1] + values[middle]) / 2)


def tree_tokens(tree) -> list[int]:
    if isinstance(tree, int):
        return [DIGIT_BASE + tree]
    operator, children = tree
    tokens = [OPERATOR_BASE + OPERATORS.index(operator)]
    for child in children:
        tokens += tree_tokens(child)
    return tokens + [CLOSE]


def decode(tokens: list[int]) -> str:
    names = {CLOSE: "]", **{OPERATOR_BASE + i: "[" + op for i, op in enumerate(OPERATORS)},
             **{DIGIT_BASE + d: str(d) for d in range(10)}}
    return " ".join(names[t] for t in tokens if t != PAD)


def _random_tree(rng: random.Random, config: ListOpsConfig, depth: int = 1):
    if depth >= config.max_depth or rng.random() >= config.operator_probability:
        return rng.randrange(10)
    arguments = rng.randint(2, config.max_args)
    return (rng.choice(OPERATORS), [_random_tree(rng, config, depth + 1) for _ in range(arguments)])


def generate_listops(count: int, config: ListOpsConfig, seed: int) -> list[tuple[list[int], int]]:
    """`count` (tokens, label) examples whose length lies in the configured range (seeded)."""
    check_positive("count", count)
    rng = random.Random(seed)
    examples = []
    while len(examples) < count:
        tree = _random_tree(rng, config)
        if isinstance(tree, int):
            continue
        tokens = tree_tokens(tree)
        if config.min_length <= len(tokens) <= config.max_length:
            examples.append((tokens, evaluate_tree(tree)))
    return examples


def pad_batch(examples: list[tuple[list[int], int]]) -> tuple[Tensor, Tensor, Tensor]:
    """-> (tokens long [B, T], mask bool [B, T], labels long [B]), T = the longest example."""
    length = max(len(tokens) for tokens, _ in examples)
    tokens = torch.full((len(examples), length), PAD, dtype=torch.long)
    for row, (sequence, _) in enumerate(examples):
        tokens[row, : len(sequence)] = torch.tensor(sequence)
    labels = torch.tensor([label for _, label in examples])
    return tokens, tokens != PAD, labels


# -- the task ------------------------------------------------------------------------------------
QUESTION = VOCAB_SIZE + 1  # after the reserved _PAUSE_ id (VOCAB_SIZE)


def _apply(operator: int, values: list[int]) -> int:
    """The operator token applied to digit values (the grammar's own evaluation)."""
    return evaluate_tree((OPERATORS[operator - OPERATOR_BASE], values))


@lru_cache(maxsize=8)
def _pool(config: ListOpsConfig, pool: int, seq_len: int) -> dict[str, tuple[Tensor, Tensor]]:
    """The pool as padded (inputs, labels) per split."""
    examples = generate_listops(pool, config, seed=0)
    inputs = torch.full((pool, seq_len), PAD, dtype=torch.long)
    labels = torch.full((pool, seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, (tokens, value) in enumerate(examples):
        inputs[row, 0] = QUESTION
        inputs[row, 1:len(tokens) + 1] = torch.tensor(tokens)
        labels[row, 0] = DIGIT_BASE + value
    return {split: (inputs[keep], labels[keep])
            for split in SPLITS for keep in [keep_split(inputs, split)]}


@register_task("listops")
class ListOps(Task):
    causal = False
    pad_id = PAD

    def __init__(self, seq_len: int = 64, min_length: int = 8, max_length: int = 63, max_depth: int = 3,
                 max_args: int = 5, operator_probability: float = 0.3, pool: int = 20000) -> None:
        check_positive("seq_len", seq_len)
        check_positive("pool", pool)
        if max_length > seq_len - 1:
            raise ValueError(f"max_length must be <= seq_len - 1 = {seq_len - 1} (one slot is the question "
                             f"token); got {max_length}")
        self.config = ListOpsConfig(min_length=min_length, max_length=max_length, max_depth=max_depth,
                                    max_args=max_args, operator_probability=operator_probability)
        self.seq_len, self.pool_size, self.name = seq_len, pool, "listops"
        self.vocab_size = QUESTION + 1

    def options(self) -> dict[str, Any]:
        c = self.config
        return {"seq_len": self.seq_len, "min_length": c.min_length, "max_length": c.max_length,
                "max_depth": c.max_depth, "max_args": c.max_args,
                "operator_probability": c.operator_probability, "pool": self.pool_size}

    def split_pool(self, split: str) -> tuple[Tensor, Tensor]:
        return _pool(self.config, self.pool_size, self.seq_len)[split]

    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        raise TypeError("ListOps draws from its per-split pools (batch), not by hashing fresh sequences")

    def batch(
        self, batch_size: int, generator: torch.Generator, split: str = "train",
    ) -> tuple[Tensor, Tensor]:
        check_batch_size(batch_size)
        inputs, labels = self.split_pool(split)
        index = torch.randint(0, inputs.shape[0], (batch_size,), generator=generator)
        return inputs[index], labels[index]

    def fixed_sample(self, split: str, sequences: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """The first `sequences` pool entries of the split (each once; all of them, if fewer)."""
        inputs, labels = self.split_pool(split)
        return inputs[:sequences], labels[:sequences]

    def _majority(self) -> int:
        labels = self.split_pool("train")[1][:, 0]
        return int(torch.bincount(labels).argmax())

    @property
    def chance(self) -> float:
        labels = self.fixed_sample("test", 10**9)[1][:, 0]
        return float((labels == self._majority()).float().mean())

    def rules(self) -> dict[str, Rule]:
        def per_row(answer) -> Rule:
            def rule(inputs: Tensor, labels: Tensor) -> Tensor:
                predictions = torch.full_like(inputs, IGNORE_INDEX)
                predictions[:, 0] = torch.tensor([answer(row) for row in inputs.tolist()], dtype=torch.long)
                return predictions
            return rule

        train_inputs, train_labels = self.split_pool("train")
        by_operator: dict[int, Counter] = {}
        for operator, label in zip(train_inputs[:, 1].tolist(), train_labels[:, 0].tolist(), strict=True):
            by_operator.setdefault(operator, Counter())[label] += 1
        majority = self._majority()

        def first_operator(row: list[int]) -> int:
            counts = by_operator.get(row[1])
            return counts.most_common(1)[0][0] if counts else majority

        def flat(row: list[int]) -> int:
            digits = [t - DIGIT_BASE for t in row if DIGIT_BASE <= t < OPERATOR_BASE]
            return DIGIT_BASE + _apply(row[1], digits)

        def direct_digits(row: list[int]) -> int:
            depth, digits = 0, []
            for token in row[2:]:
                if OPERATOR_BASE <= token < CLOSE:
                    depth += 1
                elif token == CLOSE:
                    depth -= 1
                elif DIGIT_BASE <= token < OPERATOR_BASE and depth == 0:
                    digits.append(token - DIGIT_BASE)
            return DIGIT_BASE + (_apply(row[1], digits) if digits else majority - DIGIT_BASE)

        return {"majority given the outer operator": per_row(first_operator),
                "outer operator on all digits (flat)": per_row(flat),
                "outer operator on its direct digits": per_row(direct_digits)}
