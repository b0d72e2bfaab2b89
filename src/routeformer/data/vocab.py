"""Character vocabulary built from a training split, saved with every checkpoint."""

from __future__ import annotations

import torch
from torch import Tensor

UNKNOWN = "<unk>"
# Reserved special tokens come first, so their ids are stable across corpora.
SPECIAL_TOKENS = (UNKNOWN,)


class CharVocab:
    """Maps characters to ids. Characters unseen in training map to the explicit `<unk>` id."""

    def __init__(self, chars: list[str]) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not repeat")
        self.tokens = list(SPECIAL_TOKENS) + [c for c in chars if c not in SPECIAL_TOKENS]
        self.index = {token: i for i, token in enumerate(self.tokens)}
        self.unknown_id = self.index[UNKNOWN]

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> Tensor:
        unknown = self.unknown_id
        return torch.tensor([self.index.get(c, unknown) for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(
            self.tokens[i] if self.tokens[i] not in SPECIAL_TOKENS else "\ufffd" for i in map(int, ids)
        )

    def to_dict(self) -> dict:
        return {"tokens": self.tokens}

    @classmethod
    def from_dict(cls, values: dict) -> CharVocab:
        return cls([t for t in values["tokens"] if t not in SPECIAL_TOKENS])
