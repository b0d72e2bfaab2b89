"""The sequences of the synthetic recall tasks of "Language Modeling with Learned Meta-Tokens" (Shah
et al., 2025): List Recall, Segment Counting, Parity and Copying, seeded. The tasks built on them,
with their shortcut baselines and hash splits, are in tasks/recall.py.

Every task is a sequence of `segments` segments followed by `queries` distinct questions (never the
same question twice: its answer would be visible the second time); with `meta=True`
a meta-token `_PAUSE_` (written P) closes every segment — the task-specific injection at segment
boundaries. Segment names K come from a pool of 32 (distinct within a sequence), so a longer
sequence (more segments: the length-generalisation test) uses no token unseen in training.

Exact formats (n = segment_length, one token per symbol; "=" is where the answer is asked):

- **list_recall**: segments `K [ a_1 … a_n ] P`, items a from 64 symbols; each query
  `? K j = a_j` asks for the item at index j (0-based, a number token) of list K.
- **segment_counting**: segments `K [ a_1 … a_n ] P`, items from 4 symbols; each query
  `? K s = c` asks how many times symbol s occurs in segment K (c a number token).
- **parity**: segments `K [ b_1 … b_n ] P`, bits 0/1 (number tokens); each query `? K = p` asks
  for the parity of the 1s of segment K.
- **copying**: `segments` segments `[ a_1 … a_n ] P` of items, one of them marked `< a_1 … a_n > P`
  instead; then `? =` and the marked items: `? = a_1 … a_n`. Every answer token is asked
  (teacher forcing: the model sees the earlier answer tokens).

Labels: -100 everywhere except where the next token is an answer token, whose label it is (the
next-token rule of a CausalLM). Without meta-tokens the same sequences are generated, minus P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from routeformer.data.batches import IGNORE_INDEX
from routeformer.ops._checks import check_positive

PAD, PAUSE, OPEN, CLOSE, QUERY, ANSWER, MARK_OPEN, MARK_CLOSE = range(8)
SPECIAL_NAMES = ("<pad>", "_PAUSE_", "[", "]", "?", "=", "<", ">")
NUMBER_BASE, NUMBERS = 8, 32  # number tokens 0..31 (indices, counts, bits)
KEY_BASE, KEYS = NUMBER_BASE + NUMBERS, 32  # segment names
ITEM_BASE, ITEMS = KEY_BASE + KEYS, 64  # content symbols
VOCAB_SIZE = ITEM_BASE + ITEMS
COUNTING_SYMBOLS = 4

TASKS = ("list_recall", "segment_counting", "parity", "copying")


@dataclass(frozen=True)
class RecallTask:
    name: str = "list_recall"
    segments: int = 8
    segment_length: int = 4
    queries: int = 4  # questions per sequence (copying: always one copy of the marked segment)
    meta: bool = True

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task name must be one of {TASKS}; got {self.name!r}")
        for field in ("segments", "segment_length", "queries"):
            check_positive(field, getattr(self, field))
        if self.name != "copying" and self.segments > KEYS:  # copying names no segment
            raise ValueError(f"segments must be <= {KEYS} (the pool of segment names) for {self.name}; "
                             f"got {self.segments}")
        if self.segment_length >= NUMBERS:
            raise ValueError(f"segment_length must be < {NUMBERS} (counts are number tokens); "
                             f"got {self.segment_length}")
        if self.name != "copying" and self.queries > self.distinct_questions:
            raise ValueError(f"queries must be <= {self.distinct_questions}, the distinct questions of "
                             f"{self.name} with {self.segments} segments (no question is asked twice); "
                             f"got {self.queries}")

    @property
    def distinct_questions(self) -> int:
        """How many different questions one sequence can ask."""
        per_segment = {"list_recall": self.segment_length, "segment_counting": COUNTING_SYMBOLS,
                       "parity": 1, "copying": 1}[self.name]
        return self.segments * per_segment

    def scaled(self, factor: float) -> RecallTask:
        """The same task with round(factor · segments) segments (longer sequences)."""
        return RecallTask(self.name, max(1, round(self.segments * factor)), self.segment_length,
                          self.queries, self.meta)

    def with_meta(self, meta: bool) -> RecallTask:
        return RecallTask(self.name, self.segments, self.segment_length, self.queries, meta)

    @property
    def seq_len(self) -> int:
        """Tokens per sequence (every sequence of a task has this length)."""
        n, meta = self.segment_length, int(self.meta)
        if self.name == "copying":
            return self.segments * (n + 2 + meta) + 2 + n - 1
        query = {"list_recall": 5, "segment_counting": 5, "parity": 4}[self.name]
        return self.segments * (n + 3 + meta) + self.queries * query - 1


def recall_batch(task: RecallTask, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(inputs [B, T] long, labels [B, T] long) for `task`, T = task.seq_len. Vectorised over the
    batch (tens of millions of tokens/s): a generator must cost nothing next to training."""
    check_positive("batch_size", batch_size)
    tokens, answer = _sequences(task, batch_size, generator)
    inputs = tokens[:, :-1]
    labels = tokens[:, 1:].masked_fill(~answer[:, 1:], IGNORE_INDEX)
    return inputs, labels


def _distinct(batch: int, pool: int, count: int, generator: torch.Generator) -> Tensor:
    """[batch, count] distinct integers from range(pool) per row, in random order."""
    return torch.rand(batch, pool, generator=generator).argsort(dim=1)[:, :count]


def _sequences(task: RecallTask, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Every sequence of the batch (with its final answer token) and which tokens are answers."""
    n, segments = task.segment_length, task.segments
    pause = torch.full((batch, segments, int(task.meta)), PAUSE)
    if task.name == "copying":
        marked = torch.randint(segments, (batch,), generator=generator)
        contents = ITEM_BASE + torch.randint(ITEMS, (batch, segments, n), generator=generator)
        is_marked = torch.arange(segments) == marked[:, None]  # [B, S]
        opener = torch.where(is_marked, MARK_OPEN, OPEN)[..., None]
        closer = torch.where(is_marked, MARK_CLOSE, CLOSE)[..., None]
        body = torch.cat([opener, contents, closer, pause], dim=2).flatten(1)
        copied = contents[torch.arange(batch), marked]
        tokens = torch.cat([body, torch.tensor([QUERY, ANSWER]).expand(batch, 2), copied], dim=1)
        answer = torch.zeros_like(tokens, dtype=torch.bool)
        answer[:, -n:] = True
        return tokens, answer
    keys = KEY_BASE + _distinct(batch, KEYS, segments, generator)  # [B, S]
    if task.name == "parity":
        contents = NUMBER_BASE + torch.randint(2, (batch, segments, n), generator=generator)
    else:
        symbols = COUNTING_SYMBOLS if task.name == "segment_counting" else ITEMS
        contents = ITEM_BASE + torch.randint(symbols, (batch, segments, n), generator=generator)
    body = torch.cat([keys[..., None], torch.full((batch, segments, 1), OPEN), contents,
                      torch.full((batch, segments, 1), CLOSE), pause], dim=2).flatten(1)
    # Distinct questions: a repeated question's answer would already be visible (teacher forcing).
    arity = {"list_recall": n, "segment_counting": COUNTING_SYMBOLS, "parity": 1}[task.name]
    question = _distinct(batch, segments * arity, task.queries, generator)  # [B, Q]
    segment, detail = question // arity, question % arity
    asked_key = keys.gather(1, segment)
    items = contents.gather(1, segment[..., None].expand(-1, -1, n))  # [B, Q, n]
    query, equals = torch.full_like(asked_key, QUERY), torch.full_like(asked_key, ANSWER)
    if task.name == "list_recall":
        reply = items.gather(2, detail[..., None]).squeeze(2)
        asked = [query, asked_key, NUMBER_BASE + detail, equals, reply]
    elif task.name == "segment_counting":
        symbol = ITEM_BASE + detail
        reply = NUMBER_BASE + (items == symbol[..., None]).sum(2)
        asked = [query, asked_key, symbol, equals, reply]
    else:
        reply = NUMBER_BASE + (items - NUMBER_BASE).sum(2) % 2
        asked = [query, asked_key, equals, reply]
    questions = torch.stack(asked, dim=2)  # [B, Q, per-question tokens]
    tokens = torch.cat([body, questions.flatten(1)], dim=1)
    answer = torch.zeros_like(tokens, dtype=torch.bool)
    last_of_question = torch.arange(questions.shape[2]) == questions.shape[2] - 1
    answer[:, body.shape[1]:] = last_of_question.repeat(task.queries)
    return tokens, answer

