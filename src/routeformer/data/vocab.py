"""Character vocabulary built from a training split, saved with every checkpoint."""

from __future__ import annotations

import torch
from torch import Tensor

UNKNOWN = "<unk>"
# The meta-token of "Language Modeling with Learned Meta-Tokens" (see tasks/meta_tokens.py).
PAUSE = "_PAUSE_"
# Reserved special tokens come first, so their ids are stable across corpora.
SPECIAL_TOKENS = (UNKNOWN, PAUSE)


class CharVocab:
    """Maps characters to ids. Characters unseen in training map to the explicit `<unk>` id;
    `pause_id` is the reserved meta-token `_PAUSE_` (never produced by `encode`)."""

    def __init__(self, chars: list[str], specials: tuple[str, ...] = SPECIAL_TOKENS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not repeat")
        self.tokens = list(specials) + [c for c in chars if c not in specials]
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.unknown_id = self.index[UNKNOWN]
        self.specials = specials

    @property
    def pause_id(self) -> int:
        """The id of the meta-token `_PAUSE_`."""
        if PAUSE not in self.index:
            raise ValueError("this vocabulary was saved before _PAUSE_ was reserved; "
                             "meta-tokens need a vocabulary built by this version")
        return self.index[PAUSE]

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> Tensor:
        # Special tokens have multi-character names, so no character of a text maps to one.
        unknown = self.unknown_id
        return torch.tensor([self.index.get(c, unknown) for c in text], dtype=torch.long)

    def check_known(self, text: str, argument: str = "text") -> None:
        """Raise ValueError naming `argument` and every character of `text` outside the
        vocabulary (where `encode` would give `<unk>`)."""
        unknown = sorted({c for c in text if c not in self.index})
        if unknown:
            raise ValueError(f"{argument} holds {len(unknown)} character(s) outside the model's vocabulary "
                             f"of {len(self)}: {' '.join(repr(c) for c in unknown[:20])}")

    def decode(self, ids) -> str:
        return "".join(
            self.tokens[i] if self.tokens[i] not in self.specials else "\ufffd" for i in map(int, ids)
        )

    def to_dict(self) -> dict:
        return {"tokens": self.tokens}

    @classmethod
    def from_dict(cls, values: dict) -> CharVocab:
        # Rebuild the saved id order exactly: a vocabulary saved before a special token was added
        # keeps its ids (its checkpoints stay valid).
        tokens = values["tokens"]
        specials = tuple(t for t in tokens if t in SPECIAL_TOKENS)
        if tuple(tokens[: len(specials)]) != specials:
            raise ValueError(f"a saved vocabulary lists its special tokens first; got {tokens[:4]}")
        return cls(tokens[len(specials):], specials=specials)
