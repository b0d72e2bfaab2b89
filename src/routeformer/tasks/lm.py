"""Language modelling as a task: `build_task("lm", corpus="pydoc", seq_len=128)`.

Train batches are random windows of the corpus's training text. The corpus's held-out text is
cut in two: its first half is the validation split, its second half the test split (choose on one,
report on the other). A corpus with a test split of its own (`pystdlib`) keeps its three splits.
The metric is bits per character (lower is better).

`path` (None by default) reads a local text file or folder instead of the `corpus` spec, exactly as
a training config's `data.path` does (`data.corpora.load_path`: a file split 90/10, a folder of
`train`/`valid` files, or every text file of a folder joined and split 90/10). `tokenizer` is
"char" by default (`CharVocab`: one id per character of the training text) or what `data.tokenizer`
accepts: a Hugging Face `tokenizers` model, a tokenizer.json or a directory holding one
(`data.tokenizers.build_tokenizer`); its ids are read through the token cache (data/token_cache.py)
as `routeformer train` reads them. The training ids are then the ones `routeformer train` trains on
for `data.path` / `data.tokenizer`; the held-out text is encoded whole and its ids halved as above.
`vocab` is the tokeniser either way, and with a BPE tokeniser the metric and the baselines count
bits per token, not per character. documents="start" needs `tokenizer="char"` (document boundaries
are kept in characters).

`documents="start"` (for a corpus of documents, `pystdlib`) evaluates at the beginning of one
document per window: a `fixed_sample` row (and a `batch(split="validation"/"test")` row) holds the
first T characters of a document (labels: the T after its first), so slot t of the window is
character t of the file and a name defined thousands of characters earlier in the file is really
in the context. Only documents of at least T + 1 characters qualify; shorter ones are skipped
(nothing is padded, so `mask` stays None). `fixed_sample` takes the first `sequences` qualifying
documents in file order, one window each, so a split offers at most as many evaluation windows as
it has qualifying documents; `batch` on validation / test picks a qualifying document uniformly at
random (with replacement). The training split's windows follow `train_windows`:
"anywhere" (the default) draws a window of T + 1 characters lying inside one qualifying document,
uniformly over all such windows of the split (a document of L characters offers L - T of them, so
it is drawn in proportion to L - T, and the start offset is uniform within it); "start" draws
them at document starts as evaluation does. In `pystdlib` (Python 3.11.7 standard library) the
qualifying documents per split are counted by `document_starts`. The default `documents="stream"`
is the behaviour of old: random windows of the split's documents joined into one text
(`train_windows` does not apply to it).

`copy_predictable(split, sequences)` marks, on the windows `fixed_sample` gives, the characters a
copy from far back predicts: label position t is copy-predictable for context length n when the n
characters ending at t (`inputs[t-n+1..t]`) occurred earlier in the window, their most recent
earlier occurrence (ending at s < t) ends more than `distance` characters back (t - s > distance),
and the character that followed it (`inputs[s+1]`) is `labels[t]`. A model whose attention sees
only the last `distance` characters cannot see that occurrence; a copy oracle is right on every
such character by construction. With documents="start", `evaluate_on_task` reports the model's
bits/char on these characters (`bits_per_char_copy_predictable`, per context length of
`copy_contexts`) and `copy_predictable_baselines` the n-gram floors on the same characters.

`meta_density` > 0 injects the meta-token `_PAUSE_` at that density into every window (the
pre-training of "Language Modeling with Learned Meta-Tokens"): windows then hold fewer real
characters, no loss is taken on predicting a meta-token, and `meta_token_id` names its id.

`pack_documents=True` (only with documents="stream" and no meta-tokens; False by default) packs
the training batches as a training config's `data.pack_documents` does (data/documents.py): a
document is a paragraph (text up to a blank line), `training_batch` adds document ids
(`{"documents": ...}`, so that no attention crosses a paragraph boundary) and takes no loss across
one; `batch` and evaluation stay on plain windows.

`lm_windows` draws the training windows of every language model in routeformer (`routeformer train`
trains this task).

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
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from routeformer.data.batches import IGNORE_INDEX, random_batch
from routeformer.data.corpora import load_corpus, load_path
from routeformer.data.documents import DOCUMENT_SEPARATOR, document_starts, packed_random_batch
from routeformer.data.token_cache import encode_cached
from routeformer.data.tokenizers import CHAR, Tokenizer, build_tokenizer
from routeformer.ops._checks import check_positive
from routeformer.tasks.base import Task, check_batch_size
from routeformer.tasks.meta_tokens import check_density, inject_into_batch, real_tokens_per_window
from routeformer.tasks.positions import PositionBucketSums
from routeformer.tasks.registry import register_task
from routeformer.tasks.splits import check_split

SPLIT_NAMES = ("train", "validation", "test")
WINDOW_MODES = ("stream", "start")
TRAIN_WINDOW_MODES = ("anywhere", "start")
COPY_CONTEXTS = (8, 16)
COPY_DISTANCE = 64


@dataclass(frozen=True)
class DocumentSpans:
    """Where each document of a split lies in the split's joined ids: starts and lengths [D]."""
    starts: Tensor
    lengths: Tensor


def _encoded(corpus: str, path: str | None = None,
             tokenizer: str = CHAR) -> tuple[str, Tokenizer, Tensor, Tensor, Tensor]:
    """(corpus name, tokeniser, train ids, validation ids, test ids) of the `corpus` spec, or of the
    local file or folder `path` when set, tokenised by `tokenizer`; loaded once per process while
    the files under `path` and the tokenizer file stay as they are (size and modification time)."""
    tokenizer_file = None if tokenizer == CHAR else _tokenizer_file(tokenizer)
    return _encoded_once(corpus, path, tokenizer, _stamp(path), _stamp(tokenizer_file))


@lru_cache(maxsize=4)
def _encoded_once(corpus: str, path: str | None, tokenizer: str,
                  *stamps: tuple) -> tuple[str, Tokenizer, Tensor, Tensor, Tensor]:
    text = load_corpus(corpus) if path is None else load_path(path, "path")
    vocab = build_tokenizer(tokenizer, text.train, "tokenizer")
    # characters are encoded directly, as ever; a BPE model's ids come through the token cache
    encode = vocab.encode if tokenizer == CHAR else (lambda part: encode_cached(vocab, part))
    if text.test is not None:
        return text.name, vocab, encode(text.train), encode(text.val), encode(text.test)
    held_out = encode(text.val)
    half = len(held_out) // 2
    return text.name, vocab, encode(text.train), held_out[:half], held_out[half:]


def _tokenizer_file(spec: str) -> Path:
    """The file `build_tokenizer` reads for the path `spec`: a tokenizer.json, or the one in a folder."""
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def _stamp(path: str | Path | None) -> tuple[tuple[str, int, int], ...]:
    """(file, size, modification time) of `path` or of every file under the folder `path`."""
    if path is None:
        return ()
    path = Path(path)
    if path.is_file():
        files = [path]
    else:
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else []
    return tuple((str(f), (info := f.stat()).st_size, info.st_mtime_ns) for f in files)


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


def document_windows_anywhere(ids: Tensor, starts: Tensor, lengths: Tensor, batch_size: int, seq_len: int,
                              generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """`batch_size` windows of `seq_len` slots, each lying inside one document (documents at
    `starts` [D] of `ids` with `lengths` [D], each at least `seq_len` + 1), uniformly over every
    such window: a document of L characters offers L - seq_len start offsets."""
    offsets = lengths - seq_len
    if bool((offsets < 1).any()):
        raise ValueError(f"every document needs at least seq_len + 1 = {seq_len + 1} characters; "
                         f"shortest: {int(lengths.min())}")
    ends = torch.cumsum(offsets, 0)
    draws = torch.randint(0, int(ends[-1]), (batch_size,), generator=generator)
    document = torch.searchsorted(ends, draws, right=True)
    window_starts = starts[document] + draws - (ends[document] - offsets[document])
    return document_start_windows(ids, window_starts, seq_len)


def copy_predictable_mask(inputs: Tensor, labels: Tensor, context: int = 8,
                          distance: int = COPY_DISTANCE) -> Tensor:
    """Bool [N, T]: label position t of row b is copy-predictable when the `context` characters
    ending at t (`inputs[b, t-context+1..t]`) occurred earlier in the row, their most recent earlier
    occurrence ends at s with t - s > `distance`, and `inputs[b, s+1] == labels[b, t]`. Positions
    with fewer than `context` characters read, and labels equal to IGNORE_INDEX, are False. Exact
    (n-grams compared whole, no hashing); no loop over positions.

    inputs, labels: [N, T] long. Raises ValueError for a non-positive `context` or negative
    `distance`, or shapes that differ."""
    check_positive("context", context)
    if not isinstance(distance, int) or isinstance(distance, bool) or distance < 0:
        raise ValueError(f"distance must be a non-negative integer; got {distance!r}")
    if inputs.dim() != 2 or inputs.shape != labels.shape:
        raise ValueError(f"inputs and labels must both be [N, T]; got {tuple(inputs.shape)} and "
                         f"{tuple(labels.shape)}")
    rows, length = inputs.shape
    mask = torch.zeros(rows, length, dtype=torch.bool)
    if length < context or rows == 0:
        return mask
    grams = inputs.unfold(1, context, 1)  # [N, T - context + 1, context]: gram j ends at j + context - 1
    count = grams.shape[1]
    row_index = torch.arange(rows).repeat_interleave(count)
    keyed = torch.cat([row_index[:, None], grams.reshape(-1, context)], 1)
    _, group = torch.unique(keyed, dim=0, return_inverse=True)
    slot = torch.arange(count).repeat(rows)
    order = torch.argsort(group * count + slot)
    sorted_group, sorted_slot = group[order], slot[order]
    has_previous = torch.zeros_like(sorted_group, dtype=torch.bool)
    has_previous[1:] = sorted_group[1:] == sorted_group[:-1]
    previous_slot = torch.full_like(sorted_slot, -1)
    previous_slot[1:] = sorted_slot[:-1]
    previous = torch.full((rows * count,), -1, dtype=torch.long)
    previous[order] = torch.where(has_previous, previous_slot, -1)
    previous = previous.view(rows, count)
    slots = torch.arange(count).expand(rows, count)
    far = (previous >= 0) & (slots - previous > distance)
    # gram j ends at position j + context - 1; the character after gram p is inputs[p + context]
    follower = inputs.gather(1, (previous.clamp(min=0) + context).clamp(max=length - 1))
    target = labels[:, context - 1:]
    mask[:, context - 1:] = far & (follower == target) & (target != IGNORE_INDEX)
    return mask


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
                 documents: str = "stream", train_windows: str = "anywhere", path: str | None = None,
                 tokenizer: str = CHAR, pack_documents: bool = False) -> None:
        """`corpus`: a corpus spec (data/corpora.py); `path`: a local text file or folder read instead
        (None: the spec); `tokenizer`: "char" or a tokenizer.json / tokenizer directory (module
        docstring). Raises ValueError naming the option for a bad value: a `path` that is not a
        non-empty string or holds no text, a `tokenizer` that is not "char" or a tokenizer file
        (or not "char" with documents="start"), a `pack_documents` that is not a bool or is set with
        documents="start" or meta_density > 0, and the checks of the other options."""
        check_positive("seq_len", seq_len)
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"path must be None or a local text file or folder (a non-empty string); "
                             f"got {path!r}")
        if not isinstance(tokenizer, str) or not tokenizer:
            raise ValueError(f"tokenizer must be 'char' or a path to a tokenizer.json or a folder holding "
                             f"one; got {tokenizer!r}")
        self.meta_density = check_density("meta_density", meta_density)
        if documents not in WINDOW_MODES:
            raise ValueError(f"documents must be one of {list(WINDOW_MODES)}; got {documents!r}")
        if train_windows not in TRAIN_WINDOW_MODES:
            raise ValueError(f"train_windows must be one of {list(TRAIN_WINDOW_MODES)}; "
                             f"got {train_windows!r}")
        if documents == "stream" and train_windows != "anywhere":
            raise ValueError(f"train_windows={train_windows!r} applies to documents='start'; "
                             f"documents='stream' draws its windows anywhere in the joined text")
        if path is not None and documents != "stream":
            raise ValueError(f"path={path!r} needs documents='stream': documents={documents!r} needs a "
                             "corpus of documents (corpus='pystdlib'), and a path's text is one stream")
        if tokenizer != CHAR and documents != "stream":
            raise ValueError(f"tokenizer={tokenizer!r} needs documents='stream': documents={documents!r} "
                             "keeps the document boundaries in characters (tokenizer='char')")
        if not isinstance(pack_documents, bool):
            raise ValueError(f"pack_documents must be true or false; got {pack_documents!r}")
        if pack_documents and (documents != "stream" or meta_density > 0):
            raise ValueError("pack_documents=True needs documents='stream' and meta_density=0 (packed "
                             f"windows of the joined text, no meta-tokens); got documents={documents!r}, "
                             f"meta_density={meta_density!r}")
        self.corpus, self.seq_len, self.name, self.documents = corpus, seq_len, "lm", documents
        self.pack_documents = pack_documents
        self.train_windows, self.path, self.tokenizer = train_windows, path, tokenizer
        self.copy_contexts, self.copy_distance = COPY_CONTEXTS, COPY_DISTANCE
        self._copy_masks: dict[tuple[str, int, int, int], Tensor] = {}
        self._bigram: tuple[Tensor, Tensor, Tensor] | None = None
        self.corpus_name, self.vocab, *self._ids = _encoded(corpus, path, tokenizer)
        self.vocab_size = len(self.vocab)
        self.meta_token_id = self.vocab.pause_id if meta_density > 0 else None
        self._real = real_tokens_per_window(seq_len, meta_density)
        source = f"corpus {corpus!r}" if path is None else f"path {path!r}"
        unit = "characters" if tokenizer == CHAR else "tokens"
        for split, ids in zip(SPLIT_NAMES, self._ids, strict=True):
            if len(ids) < seq_len + 1:
                raise ValueError(f"seq_len={seq_len} is longer than the {split} text of {source} "
                                 f"({len(ids)} {unit})")
        self._paragraph_starts: Tensor | None = None  # pack_documents: built at the first training batch
        self._document_starts: list[Tensor] | None = None
        self._document_lengths: list[Tensor] = []
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
                self._document_lengths.append(span.lengths[qualifying])

    def options(self) -> dict[str, Any]:
        options = {"corpus": self.corpus, "seq_len": self.seq_len}
        if self.meta_density:
            options["meta_density"] = self.meta_density
        if self.path is not None:
            options["path"] = self.path
        if self.tokenizer != CHAR:
            options["tokenizer"] = self.tokenizer
        if self.pack_documents:
            options["pack_documents"] = True
        if self.documents == "stream":
            return options
        # train_windows is always named, so a record trained at starts never reads as one trained anywhere
        return {**options, "documents": self.documents, "train_windows": self.train_windows}

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
        """Random windows of the split's text (the splits are disjoint stretches of the corpus); with
        documents="start", at qualifying documents' starts, except on the training split with
        train_windows="anywhere": anywhere inside one qualifying document (module docstring)."""
        check_batch_size(batch_size)
        starts = self.document_starts(split)
        if starts is None:
            return lm_windows(self.ids(split), batch_size, self.seq_len, generator,
                              meta_density=self.meta_density, meta_id=self.meta_token_id)
        if check_split(split) == "train" and self.train_windows == "anywhere":
            inputs, labels = document_windows_anywhere(self.ids(split), starts, self._document_lengths[0],
                                                       batch_size, self._real, generator)
            return self._inject(inputs, labels, generator)
        rows = torch.randint(0, len(starts), (batch_size,), generator=generator)
        inputs, labels = document_start_windows(self.ids(split), starts[rows], self._real)
        return self._inject(inputs, labels, generator)

    def training_batch(
        self, batch_size: int, generator: torch.Generator,
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """`batch(batch_size, generator, "train")` and {}; with pack_documents, the same windows packed:
        labels -100 at each paragraph's last token and `{"documents": ids [B, T]}` (module docstring)."""
        if not self.pack_documents:
            return super().training_batch(batch_size, generator)
        check_batch_size(batch_size)
        if self._paragraph_starts is None:
            separator = self.vocab.encode(DOCUMENT_SEPARATOR)
            self._paragraph_starts = document_starts(self.ids("train"), separator)
        inputs, labels, documents = packed_random_batch(self.ids("train"), self._paragraph_starts,
                                                        batch_size, self.seq_len, generator)
        return inputs, labels, {"documents": documents}

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

    def copy_predictable(self, split: str = "test", sequences: int = 1024, context: int = 8,
                         distance: int | None = None) -> Tensor | None:
        """Bool [N, T] over the label positions of `fixed_sample(split, sequences)`: the characters a
        copy from more than `distance` characters back (default `copy_distance`) predicts, for
        `context` characters of context (`copy_predictable_mask`; module docstring). None unless
        documents="start" (a stream window is not a place in a file). Computed once per task
        instance and arguments. The evaluator asks for each of `copy_contexts` at `copy_distance`."""
        if self.documents != "start":
            return None
        distance = self.copy_distance if distance is None else distance
        key = (check_split(split), sequences, context, distance)
        if key not in self._copy_masks:
            inputs, labels = self.fixed_sample(split, sequences)
            self._copy_masks[key] = copy_predictable_mask(inputs, labels, context, distance)
        return self._copy_masks[key]

    def copy_predictable_baselines(self, sequences: int = 1024,
                                   split: str = "test") -> dict[str, dict[str, float]]:
        """On `fixed_sample(split, sequences)`, per context length of `copy_contexts`: the fraction
        of asked characters that are copy-predictable ("copy-predictable fraction") and the unigram
        and bigram models' bits/char on those characters. These n-gram models read no more than the
        previous character, so they cannot see the occurrence that predicts the character; the copy
        oracle itself is right on every one of them. Empty unless documents="start"."""
        if self.documents != "start":
            return {}
        inputs, labels = self.fixed_sample(split, sequences)
        asked = labels != IGNORE_INDEX
        safe = labels.clamp(min=0)
        bits = {"unigram": -self._unigram()[safe].log2(),
                "bigram": -self._bigram_probability(inputs, safe).log2()}
        floors: dict[str, dict[str, float]] = {"copy-predictable fraction": {}}
        for context in self.copy_contexts:
            mask = self.copy_predictable(split, sequences, context)
            floors["copy-predictable fraction"][str(context)] = float(mask.sum()) / max(int(asked.sum()), 1)
            for name, values in bits.items():
                chosen = values[mask]
                floors.setdefault(f"{name} (bits/char)", {})[str(context)] = (
                    float(chosen.mean()) if chosen.numel() else math.nan)
        return floors

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
        test = self.ids("test")
        unigram_bits = -self._unigram().log2()[test[1:]].mean()
        bigram_bits = -self._bigram_probability(test[:-1], test[1:]).log2().mean()
        return {"unigram (bits/char)": float(unigram_bits), "bigram (bits/char)": float(bigram_bits)}

    def _unigram(self) -> Tensor:
        """The add-one unigram model fitted on train: probabilities [V], float64."""
        unigram = torch.bincount(self.ids("train"), minlength=self.vocab_size).double() + 1
        return unigram / unigram.sum()

    def _bigram_probability(self, previous: Tensor, target: Tensor) -> Tensor:
        """The add-one bigram model fitted on train, P(`target` | `previous`) elementwise (float64, the
        shape of `previous`): (count of the pair + 1) / (count of `previous` as a previous token + V).
        Only the pairs that occur are counted (no [V, V] table, which a BPE vocabulary of 50k ids
        would need 20 GB for); counted once per task instance."""
        if self._bigram is None:
            train, size = self.ids("train"), self.vocab_size
            keys, counts = torch.unique(train[:-1] * size + train[1:], return_counts=True)
            rows = torch.bincount(train[:-1], minlength=size).double() + size
            self._bigram = keys, counts.double(), rows
        keys, counts, rows = self._bigram
        query = previous * self.vocab_size + target
        where = torch.searchsorted(keys, query).clamp(max=len(keys) - 1)
        count = torch.where(keys[where] == query, counts[where], 0.0)
        return (count + 1) / rows[previous]

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
        floors = {}
        for name, probability in (("unigram", self._unigram()[target]),
                                  ("bigram", self._bigram_probability(previous, target))):
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
    per evaluation window from its first character (documents="start"; training windows anywhere in
a document, train_windows="anywhere"), T = 4096 by default. Names are defined
    thousands of characters before they are used, so reading far back pays; compare --long trains
    it, and reports bits per character per position bucket beside the n-gram floors of the same
    buckets (`position_baselines`). Needs ../shared/data/python-stdlib (or `corpus="pystdlib:DIR"`);
    nothing is downloaded."""

    def __init__(self, corpus: str = "pystdlib", seq_len: int = 4096, meta_density: float = 0.0,
                 documents: str = "start", train_windows: str = "anywhere") -> None:
        super().__init__(corpus=corpus, seq_len=seq_len, meta_density=meta_density, documents=documents,
                         train_windows=train_windows)
        self.name = "code_lm"
