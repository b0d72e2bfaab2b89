"""Character-level language modelling as a task: `build_task("lm", corpus="pydoc", seq_len=128)`.

Train batches are random windows of the corpus's training text. The corpus's held-out text is
cut in two: its first half is the validation split, its second half the test split (choose on one,
report on the other). The metric is bits per character (lower is better).

`meta_density` > 0 injects the meta-token `_PAUSE_` at that density into every window (the
pre-training of "Language Modeling with Learned Meta-Tokens"): windows then hold fewer real
characters, no loss is taken on predicting a meta-token, and `meta_token_id` names its id.

`lm_windows` draws the training windows of every language model in routeformer: this task's and
those of `routeformer train` (train/loop.py, on its own corpus and tokenizer), so both train on the
same kind of batch from the same generator calls.

`chance` is the input-blind uniform guess, log2(V) bits; the baselines are n-gram models fitted on
the training text (add-one smoothing), which ignore everything but the last n-1 characters: what
attention is for.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from routeformer.data.batches import random_batch
from routeformer.data.corpora import load_corpus
from routeformer.data.vocab import CharVocab
from routeformer.ops._checks import check_positive
from routeformer.tasks.base import Task, check_batch_size
from routeformer.tasks.meta_tokens import check_density, inject_into_batch, real_tokens_per_window
from routeformer.tasks.registry import register_task
from routeformer.tasks.splits import check_split


@lru_cache(maxsize=4)
def _encoded(corpus: str) -> tuple[str, CharVocab, Tensor, Tensor, Tensor]:
    """(corpus name, vocabulary, train ids, validation ids, test ids), loaded once per process."""
    text = load_corpus(corpus)
    vocab = CharVocab.from_text(text.train)
    held_out = vocab.encode(text.val)
    half = len(held_out) // 2
    return text.name, vocab, vocab.encode(text.train), held_out[:half], held_out[half:]


def lm_windows(ids: Tensor, batch_size: int, seq_len: int, generator: torch.Generator, *,
               meta_density: float = 0.0, meta_id: int | None = None) -> tuple[Tensor, Tensor]:
    """`batch_size` random windows of `seq_len` slots from the token stream `ids` (inputs, next-token
    labels); with `meta_density` > 0, meta-tokens `meta_id` injected (no loss on predicting one)."""
    if meta_density == 0:
        return random_batch(ids, batch_size, seq_len, generator)
    inputs, labels = random_batch(ids, batch_size, real_tokens_per_window(seq_len, meta_density), generator)
    return inject_into_batch(inputs, labels, seq_len, meta_id=meta_id, density=meta_density,
                             generator=generator)


@register_task("lm")
class CharLM(Task):
    causal = True
    metric = "bits_per_char"
    higher_is_better = False

    def __init__(self, corpus: str = "pydoc", seq_len: int = 128, meta_density: float = 0.0) -> None:
        check_positive("seq_len", seq_len)
        self.meta_density = check_density("meta_density", meta_density)
        self.corpus, self.seq_len, self.name = corpus, seq_len, "lm"
        self.corpus_name, self.vocab, *self._ids = _encoded(corpus)
        self.vocab_size = len(self.vocab)
        self.meta_token_id = self.vocab.pause_id if meta_density > 0 else None
        self._real = real_tokens_per_window(seq_len, meta_density)
        for split, ids in zip(("train", "validation", "test"), self._ids, strict=True):
            if len(ids) < seq_len + 1:
                raise ValueError(f"seq_len={seq_len} is longer than the {split} text of corpus "
                                 f"{corpus!r} ({len(ids)} characters)")

    def options(self) -> dict[str, Any]:
        options = {"corpus": self.corpus, "seq_len": self.seq_len}
        return {**options, "meta_density": self.meta_density} if self.meta_density else options

    def ids(self, split: str) -> Tensor:
        return self._ids[("train", "validation", "test").index(check_split(split))]

    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        raise TypeError("CharLM draws windows per split (batch / fixed_sample), not by hashing")

    def batch(
        self, batch_size: int, generator: torch.Generator, split: str = "train",
    ) -> tuple[Tensor, Tensor]:
        """Random windows of the split's text (the splits are disjoint stretches of the corpus)."""
        check_batch_size(batch_size)
        return lm_windows(self.ids(split), batch_size, self.seq_len, generator,
                          meta_density=self.meta_density, meta_id=self.meta_token_id)

    def fixed_sample(self, split: str, sequences: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """The first `sequences` non-overlapping windows of the split (all it has, if fewer)."""
        ids = self.ids(split)
        count = min(sequences, (len(ids) - 1) // self._real)
        usable = count * self._real
        inputs, labels = ids[:usable].view(count, self._real), ids[1:usable + 1].view(count, self._real)
        return self._inject(inputs, labels, torch.Generator().manual_seed(seed))

    def _inject(self, inputs: Tensor, labels: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        if self.meta_token_id is None:
            return inputs, labels
        return inject_into_batch(inputs, labels, self.seq_len, meta_id=self.meta_token_id,
                                 density=self.meta_density, generator=generator)

    @property
    def chance(self) -> float:
        return math.log2(self.vocab_size)

    def baselines(self, sequences: int = 0) -> dict[str, float]:
        """Bits per character of unigram and bigram models (fitted on train) on the test split."""
        train, test = self.ids("train"), self.ids("test")
        size = self.vocab_size
        unigram = torch.bincount(train, minlength=size).double() + 1
        unigram_bits = -(unigram / unigram.sum()).log2()[test[1:]].mean()
        pair_ids = train[:-1] * size + train[1:]
        pairs = torch.bincount(pair_ids, minlength=size * size).double().view(size, size) + 1
        bigram = pairs / pairs.sum(1, keepdim=True)
        bigram_bits = -bigram[test[:-1], test[1:]].log2().mean()
        return {"unigram (bits/char)": float(unigram_bits), "bigram (bits/char)": float(bigram_bits)}

    def floor(self) -> float:
        """The number a model must beat (bits/char): the best n-gram baseline."""
        return min([self.chance, *self.baselines().values()])
