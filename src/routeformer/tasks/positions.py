"""Position buckets: where in a window a next-token loss was taken, grouped into ranges.

A window's slot t (0-based) predicts the token at t + 1 having read t + 1 tokens, so a loss at
slot t has t + 1 tokens of context in the window. A bucket "lo-hi" holds the slots lo <= t < hi.
Bucket edges are a strictly increasing list of integers that starts at 0; `position_buckets` clips
them to the window: the edges at or beyond T are dropped and T is the last edge (the bucket names
say the ranges actually used). The default edges are 0, 256, 1024, 2048, 4096, 8192, ... so that at
T = 2048 the buckets are 0-256, 256-1024, 1024-2048, and a mechanism that reads only nearby text
shows where it loses.

With meta-tokens injected (lm's `meta_density`), a slot is a slot of the window, meta-tokens
included (no loss is taken at a slot whose next token is a meta-token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_POSITION_EDGES = (0, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def position_buckets(seq_len: int, edges: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The buckets [(lo, hi), ...] covering slots 0..seq_len-1: `edges` (default
    DEFAULT_POSITION_EDGES, extended by doubling past its last entry) clipped to `seq_len`."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer; got {seq_len!r}")
    if edges is None:
        edges = list(DEFAULT_POSITION_EDGES)
        while edges[-1] < seq_len:
            edges.append(edges[-1] * 2)
    edges = list(edges)
    if (not edges or any(not isinstance(e, int) or isinstance(e, bool) for e in edges) or edges[0] != 0
            or any(b <= a for a, b in zip(edges, edges[1:], strict=False))):
        raise ValueError(f"position_buckets must be strictly increasing integers starting at 0 "
                         f"(e.g. [0, 256, 1024, 2048]); got {edges!r}")
    kept = [edge for edge in edges if edge < seq_len] + [seq_len]
    return list(zip(kept, kept[1:], strict=False))


def bucket_name(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}-{bucket[1]}"


def bucket_of(slots: Tensor, buckets: list[tuple[int, int]]) -> Tensor:
    """The index of the bucket each slot (long tensor) falls in."""
    upper = torch.tensor([hi for _, hi in buckets], dtype=slots.dtype)
    return torch.bucketize(slots, upper, right=True)


class PositionBucketSums:
    """Running sums of per-token losses (nats) and counts per position bucket."""

    def __init__(self, seq_len: int, edges: Sequence[int] | None = None) -> None:
        self.buckets = position_buckets(seq_len, edges)
        self.nats = torch.zeros(len(self.buckets), dtype=torch.float64)
        self.counts = torch.zeros(len(self.buckets), dtype=torch.long)

    def add(self, token_nats: Tensor, labels: Tensor, ignore_index: int = -100) -> None:
        """Add the losses `token_nats` [N] taken at the positions of `labels` [B, T] that are not
        `ignore_index`, in row-major order (as `labels[labels != ignore_index]` lists them)."""
        asked = labels != ignore_index
        slots = torch.arange(labels.shape[1]).expand_as(labels)[asked]
        if slots.numel() != token_nats.numel():
            raise ValueError(f"token_nats has {token_nats.numel()} losses; labels ask {slots.numel()}")
        index = bucket_of(slots, self.buckets)
        self.nats += torch.bincount(index, weights=token_nats.detach().double().cpu(),
                                    minlength=len(self.buckets))
        self.counts += torch.bincount(index, minlength=len(self.buckets))

    def bits(self) -> dict[str, float]:
        """Bits per token in each bucket (NaN where a bucket holds no asked position)."""
        return {bucket_name(bucket): (float(nats) / count / math.log(2) if count else math.nan)
                for bucket, nats, count in zip(self.buckets, self.nats, self.counts.tolist(), strict=True)}

    def token_counts(self) -> dict[str, int]:
        counts = self.counts.tolist()
        return {bucket_name(bucket): count for bucket, count in zip(self.buckets, counts, strict=True)}
