"""Sliding-window attention, the specification (`local_attention_reference`).

Axes: B batch, H heads, T length, d head dim.
Causal: token i reads keys [i - window + 1, i]. Non-causal: keys [i - window, i + window].
Written the obvious way: the dense T×T score matrix with the band mask (and, for packed
`documents`, a same-document mask), then the masked softmax of ops/full/reference.py. `in_window`
is a plain copy of the fast path's (ops/local/op.py), so that this twin imports no fast path
(tests/ops/test_references_independent.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.full.reference import masked_attention_reference


def in_window(offset: Tensor, window: int, causal: bool) -> Tensor:
    """offset = key position - query position -> bool: the key lies in the query's window."""
    if causal:
        return (offset <= 0) & (offset > -window)
    return offset.abs() <= window


def local_band(length: int, window: int, causal: bool, device: torch.device) -> Tensor:
    """Bool [T, T]: key j is inside query i's window."""
    positions = torch.arange(length, device=device)
    return in_window(positions[None, :] - positions[:, None], window, causal)


def local_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, window: int, mask: Tensor | None = None,
    causal: bool = False, scale: float | None = None, documents: Tensor | None = None,
) -> Tensor:
    """The specification of `local_attention`: dense scores with a band mask (and, for packed
    `documents`, a same-document mask)."""
    check_qkv(q, k, v, mask, causal=True)
    check_positive("window", window)
    batch, _, length, _ = q.shape
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    allowed = local_band(length, window, causal, q.device)[None, None] & valid[:, None, None, :]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    return masked_attention_reference(q, k, v, allowed, scale)
