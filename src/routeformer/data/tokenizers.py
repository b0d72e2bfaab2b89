"""Tokenisers of the language-model runs: characters (the default) or a BPE model from a file.

`data.tokenizer` names one:

| value | what |
|---|---|
| `char` | `CharVocab`: one id per character seen in the training split (data/vocab.py) |
| `PATH` | a Hugging Face `tokenizers` model (BPE, ...): a `tokenizer.json`, or a directory holding one |

(A directory as `save_pretrained` writes it, e.g. a GPT-2 or Llama tokenizer directory, holds one.)

Both kinds offer the same small interface (`encode`, `decode`, `len`, `pause_id`, `to_dict`) and
travel inside every checkpoint as plain JSON (`to_dict`), so a checkpoint decodes its own ids
without the original file. A BPE model gets the meta-token `_PAUSE_` added as a special token when
it has none (tasks/meta_tokens.py needs its id). The `tokenizers` package is optional
(`pip install 'routeformer[tokenizers]'`); nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from routeformer.data.vocab import PAUSE, CharVocab

CHAR = "char"
_CHUNK_CHARS = 1 << 16  # BPE encodes the text in pieces of about this size, cut after a newline


class Tokenizer(Protocol):
    """What the training loop, evaluation and sampling use of a tokeniser."""

    def encode(self, text: str) -> Tensor: ...
    def decode(self, ids) -> str: ...
    def __len__(self) -> int: ...
    @property
    def pause_id(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...


class BPETokenizer:
    """A `tokenizers.Tokenizer` (BPE or any other model it holds) behind the Tokenizer interface."""

    def __init__(self, tokenizer: Any, source: str = "") -> None:
        if tokenizer.token_to_id(PAUSE) is None:
            tokenizer.add_special_tokens([PAUSE])
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def from_path(cls, path: str | Path, option: str = "data.tokenizer") -> BPETokenizer:
        """Load `path`: a tokenizer.json, or a directory holding tokenizer.json. Raises ValueError,
        naming `option` (the setting that gave the path), when there is no such file, it is not a
        tokenizers JSON file, or the `tokenizers` package is missing."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            where = f"directory {str(path)!r} has no tokenizer.json" if path.is_dir() else \
                f"{str(path)!r} does not exist"
            raise ValueError(f"{option} must be 'char', a tokenizer.json file or a Hugging Face "
                             f"tokenizer directory; {where}")
        Tokenizer = _tokenizers(option).Tokenizer
        try:
            return cls(Tokenizer.from_file(str(file)), source=str(file))
        except Exception as error:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(f"{option} {str(file)!r} is not a tokenizers JSON file: "
                             f"{' '.join(str(error).split())}") from None

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pause_id(self) -> int:
        return self.tokenizer.token_to_id(PAUSE)

    def encode(self, text: str) -> Tensor:
        """Token ids of `text`, encoded in newline-cut pieces (one call per piece would be slow; one call
        for a whole corpus holds every intermediate string at once). No special tokens are added."""
        pieces = _pieces(text, _CHUNK_CHARS)
        encodings = self.tokenizer.encode_batch(pieces, add_special_tokens=False)
        ids = [token for encoding in encodings for token in encoding.ids]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "tokenizers", "source": self.source, "tokenizer": json.loads(self.tokenizer.to_str())}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BPETokenizer:
        Tokenizer = _tokenizers().Tokenizer
        return cls(Tokenizer.from_str(json.dumps(values["tokenizer"])), source=values.get("source", ""))


def build_tokenizer(spec: str, train_text: str, option: str = "data.tokenizer") -> Tokenizer:
    """The tokeniser `data.tokenizer` names (see the module docstring); `char` builds its vocabulary
    from `train_text`. Raises ValueError naming `option` (the setting that gave `spec`) for a spec
    that is not a non-empty string or a path that holds no tokenizer."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{option} must be 'char' or a path to a tokenizer; got {spec!r}")
    if spec == CHAR:
        return CharVocab.from_text(train_text)
    return BPETokenizer.from_path(spec, option)


def tokenizer_from_dict(values: dict[str, Any]) -> Tokenizer:
    """The tokeniser a checkpoint saved (`to_dict`): a BPE model, or a character vocabulary (older
    checkpoints saved only `{"tokens": [...]}`)."""
    if values.get("kind") == "tokenizers":
        return BPETokenizer.from_dict(values)
    return CharVocab.from_dict(values)


def _pieces(text: str, size: int) -> list[str]:
    pieces, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        pieces.append(text[start:end])
        start = end
    return pieces


def _tokenizers(option: str = "data.tokenizer"):
    try:
        import tokenizers
    except ImportError:
        raise ValueError(f"{option} PATH needs the `tokenizers` package: "
                         "pip install 'routeformer[tokenizers]'") from None
    return tokenizers
