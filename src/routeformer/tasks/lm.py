"""Character-level language modelling as a task: `build_task("lm", corpus="pydoc", seq_len=128)`.

Train batches are random windows of the corpus's training text. The corpus's held-out text is
cut in two: its first half is the validation split, its second half the test split (choose on one,
report on the other). A corpus with a test split of its own (`pystdlib`) keeps its three splits.
The metric is bits per character (lower is better).

`documents="start"` (for a corpus of documents, `pystdlib`) draws every window from the beginning
of one document instead: row b holds the first T characters of a document (labels: the T after its
first), so slot t of the window is character t of the file and a name defined thousands of
characters earlier in the file is really in the context. Only documents of at least T + 1
characters qualify; shorter ones are skipped (nothing is padded, so `mask` stays None). Training
rows pick a qualifying document uniformly at random (with replacement); `fixed_sample` (validation,
test) takes the first `sequences` qualifying documents in file order, one window each, so a split
offers at most as many evaluation windows as it has qualifying documents. In `pystdlib` (Python
3.11.7 standard library) the qualifying documents (train / valid / test) are 549 / 31 / 28 at
T = 2048 and 452 / 28 / 21 at T = 4096. The default `documents="stream"` is the behaviour of old:
random windows of the split's documents joined into one text.

`meta_density` > 0 injects the meta-token `_PAUSE_` at that density into every window (the
pre-training of "Language Modeling with Learned Meta-Tokens"): windows then hold fewer real
characters, no loss is taken on predicting a meta-token, and `meta_token_id` names its id.

`lm_windows` draws the training windows of every language model in routeformer: this task's and
those of `routeformer train` (train/loop.py, on its own corpus and tokenizer), so both train on the
same kind of batch from the same generator calls.

`chance` is the input-blind uniform guess, log2(V) bits; the baselines are n-gram models fitted on
the training text (add-one smoothing), which ignore everything but the last n-1 characters: what
attention is for. `position_baselines` gives the same floors per position bucket (tasks/positions.py)
on the fixed test sample, beside the model's `bits_per_char_by_position` (train/on_task.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from routeformer.data.batches import IGNORE_INDEX, random_batch
from routeformer.data.corpora import load_corpus
from routeformer.data.vocab import CharVocab
from routeformer.ops._checks import check_positive
from routeformer.tasks.base import Task, check_batch_size
from routeformer.tasks.meta_tokens import check_density, inject_into_batch, real_tokens_per_window
from routeformer.tasks.positions import PositionBucketSums
from routeformer.tasks.registry import register_task
from routeformer.tasks.splits import check_split

SPLIT_NAMES = ("train", "validation", "test")
WINDOW_MODES = ("stream", "start")


@dataclass(frozen=True)
class DocumentSpans:
    """Where each document of a split lies in the split's joined ids: starts and lengths [D]."""
    starts: Tensor
    lengths: Tensor


@lru_cache(maxsize=4)
def _encoded(corpus: str) -> tuple[str, CharVocab, Tensor, Tensor, Tensor]:
    """(corpus name, vocabulary, train ids, validation ids, test ids), loaded once per process."""
    text = load_corpus(corpus)
    vocab = CharVocab.from_text(text.train)
    if text.test is not None:
        return text.name, vocab, vocab.encode(text.train), vocab.encode(text.val), vocab.encode(text.test)
    held_out = vocab.encode(text.val)
    half = len(held_out) // 2
    return text.name, vocab, vocab.encode(text.train), held_out[:half], held_out[half:]


@lru_cache(maxsize=4)
def _document_spans(corpus: str) -> tuple[DocumentSpans, ...] | None:
    """Per split (train, validation, test), the documents' spans in its ids; None for a stream corpus."""
    text = load_corpus(corpus)
    if text.documents is None:
        return None
    spans = []
    for split in SPLIT_NAMES:
        lengths = torch.tensor([len(document) for document in text.documents[split]], dtype=torch.long)
        spans.append(DocumentSpans(torch.cumsum(lengths, 0) - lengths, lengths))
    return tuple(spans)


def document_start_windows(ids: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """The windows of `seq_len` slots at `starts` [B] of `ids` (inputs, next-token labels)."""
    windows = ids[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


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

    def __init__(self, corpus: str = "pydoc", seq_len: int = 128, meta_density: float = 0.0,
                 documents: str = "stream") -> None:
        check_positive("seq_len", seq_len)
        self.meta_density = check_density("meta_density", meta_density)
        if documents not in WINDOW_MODES:
            raise ValueError(f"documents must be one of {list(WINDOW_MODES)}; got {documents!r}")
        self.corpus, self.seq_len, self.name, self.documents = corpus, seq_len, "lm", documents
        self.corpus_name, self.vocab, *self._ids = _encoded(corpus)
        self.vocab_size = len(self.vocab)
        self.meta_token_id = self.vocab.pause_id if meta_density > 0 else None
        self._real = real_tokens_per_window(seq_len, meta_density)
        for split, ids in zip(SPLIT_NAMES, self._ids, strict=True):
            if len(ids) < seq_len + 1:
                raise ValueError(f"seq_len={seq_len} is longer than the {split} text of corpus "
                                 f"{corpus!r} ({len(ids)} characters)")
        self._document_starts: list[Tensor] | None = None
        if documents == "start":
            spans = _document_spans(corpus)
            if spans is None:
                raise ValueError(f"documents='start' needs a corpus of documents (pystdlib); corpus "
                                 f"{corpus!r} is one stream of text")
            self._document_starts = []
            for split, span in zip(SPLIT_NAMES, spans, strict=True):
                qualifying = span.lengths >= self._real + 1
                if not bool(qualifying.any()):
                    raise ValueError(
                        f"documents='start' with seq_len={seq_len}: no {split} document of corpus "
                        f"{corpus!r} has the {self._real + 1} characters a window needs (longest: "
                        f"{int(span.lengths.max())})")
                self._document_starts.append(span.starts[qualifying])

    def options(self) -> dict[str, Any]:
        options = {"corpus": self.corpus, "seq_len": self.seq_len}
        if self.meta_density:
            options["meta_density"] = self.meta_density
        return {**options, "documents": self.documents} if self.documents != "stream" else options

    def document_starts(self, split: str) -> Tensor | None:
        """Where the windows of `split` may start in `ids(split)` (documents="start"), else None:
        the starts of the documents of at least T + 1 characters, in file order."""
        if self._document_starts is None:
            return None
        return self._document_starts[SPLIT_NAMES.index(check_split(split))]

    def ids(self, split: str) -> Tensor:
        return self._ids[("train", "validation", "test").index(check_split(split))]

    def generate(self, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        raise TypeError("CharLM draws windows per split (batch / fixed_sample), not by hashing")

    def batch(
        self, batch_size: int, generator: torch.Generator, split: str = "train",
    ) -> tuple[Tensor, Tensor]:
        """Random windows of the split's text (the splits are disjoint stretches of the corpus)."""
        check_batch_size(batch_size)
        starts = self.document_starts(split)
        if starts is None:
            return lm_windows(self.ids(split), batch_size, self.seq_len, generator,
                              meta_density=self.meta_density, meta_id=self.meta_token_id)
        rows = torch.randint(0, len(starts), (batch_size,), generator=generator)
        inputs, labels = document_start_windows(self.ids(split), starts[rows], self._real)
        return self._inject(inputs, labels, generator)

    def fixed_sample(self, split: str, sequences: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """The first `sequences` non-overlapping windows of the split (all it has, if fewer); with
        documents="start", the windows at the starts of its first `sequences` qualifying documents."""
        ids = self.ids(split)
        starts = self.document_starts(split)
        if starts is not None:
            inputs, labels = document_start_windows(ids, starts[:sequences], self._real)
            return self._inject(inputs, labels, torch.Generator().manual_seed(seed))
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

    def _ngram_probabilities(self) -> tuple[Tensor, Tensor]:
        """Add-one unigram [V] and bigram [V, V] (row: previous character) fitted on train."""
        train, size = self.ids("train"), self.vocab_size
        unigram = torch.bincount(train, minlength=size).double() + 1
        pairs = torch.bincount(train[:-1] * size + train[1:], minlength=size * size).double()
        pairs = pairs.view(size, size) + 1
        return unigram / unigram.sum(), pairs / pairs.sum(1, keepdim=True)

    def position_baselines(self, sequences: int = 1024, position_buckets: Sequence[int] | None = None,
                           split: str = "test") -> dict[str, dict[str, float]]:
        """Bits per character of the unigram and bigram models (fitted on train) per position
        bucket, on `fixed_sample(split, sequences)`: the windows `evaluate_on_task` scores, so the
        buckets match its `bits_per_char_by_position`. A bigram reads only the previous character,
        so its numbers change across buckets only because the text does (file headers, imports).
        With meta-tokens injected, the bigram's previous token may be `_PAUSE_` (a uniform row)."""
        inputs, labels = self.fixed_sample(split, sequences)
        asked = labels != IGNORE_INDEX
        previous, target = inputs[asked], labels[asked]
        unigram, bigram = self._ngram_probabilities()
        floors = {}
        for name, probability in (("unigram", unigram[target]), ("bigram", bigram[previous, target])):
            sums = PositionBucketSums(self.seq_len, position_buckets)
            sums.add(-probability.log(), labels)
            floors[f"{name} (bits/char)"] = sums.bits()
        return floors

    def floor(self) -> float:
        """The number a model must beat (bits/char): the best n-gram baseline."""
        return min([self.chance, *self.baselines().values()])


@register_task("code_lm")
class CodeLM(CharLM):
    """The long-range character LM: `lm` on the Python standard library (`pystdlib`), one document
    per window from its first character (documents="start"), T = 4096 by default. Names are defined
    thousands of characters before they are used, so reading far back pays; compare --long trains
    it, and reports bits per character per position bucket beside the n-gram floors of the same
    buckets (`position_baselines`). Needs ../shared/data/python-stdlib (or `corpus="pystdlib:DIR"`);
    nothing is downloaded."""

    def __init__(self, corpus: str = "pystdlib", seq_len: int = 4096, meta_density: float = 0.0,
                 documents: str = "start") -> None:
        super().__init__(corpus=corpus, seq_len=seq_len, meta_density=meta_density, documents=documents)
        self.name = "code_lm"
