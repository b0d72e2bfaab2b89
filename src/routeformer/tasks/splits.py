"""Disjoint train / validation / test streams by construction.

Each sequence belongs to exactly one split, decided by a fixed hash of its tokens: 80% of the
hash space is train, 10% validation, 10% test. A generator that draws from one split discards
the sequences that hash elsewhere, so no seed can ever make a test sequence a training one.
"""

from __future__ import annotations

import torch
from torch import Tensor

SPLITS = ("train", "validation", "test")
_BUCKETS = 10
_SPLIT_BUCKETS = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}
_weights: dict[int, Tensor] = {}


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}; got {split!r}")
    return split


def _position_weights(length: int) -> Tensor:
    """Fixed odd 62-bit multipliers, one per position (the same in every process and version)."""
    if length not in _weights:
        generator = torch.Generator().manual_seed(0x5EED)
        _weights[length] = torch.randint(1, 2**62, (length,), generator=generator, dtype=torch.long) | 1
    return _weights[length]


def sequence_hash(inputs: Tensor) -> Tensor:
    """A 64-bit hash per row of `inputs` [N, T] (integer overflow wraps, as intended)."""
    if inputs.dim() != 2:
        raise ValueError(f"inputs must have shape [N, T]; got {tuple(inputs.shape)}")
    mixed = ((inputs.long() + 1) * _position_weights(inputs.shape[1])).sum(dim=1)
    mixed = mixed ^ (mixed >> 31)
    mixed = mixed * 0x5851F42D4C957F2D
    return mixed ^ (mixed >> 29)


def split_of(inputs: Tensor) -> list[str]:
    """The split each row of `inputs` belongs to."""
    buckets = torch.remainder(sequence_hash(inputs), _BUCKETS).tolist()
    return [next(name for name, owned in _SPLIT_BUCKETS.items() if bucket in owned) for bucket in buckets]


def keep_split(inputs: Tensor, split: str) -> Tensor:
    """Bool [N]: which rows of `inputs` belong to `split`."""
    owned = _SPLIT_BUCKETS[check_split(split)]
    buckets = torch.remainder(sequence_hash(inputs), _BUCKETS)
    return (buckets >= owned.start) & (buckets < owned.stop)
