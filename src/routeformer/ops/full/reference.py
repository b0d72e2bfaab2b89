"""Full softmax attention, the specification (`full_attention_reference`) and the masked softmax
every masked-softmax fast path in routeformer is compared with (`masked_attention_reference`).

Axes: B batch, H heads, T length (Tq queries, Tk keys), d head dim.
Written the obvious way: dense scores, an explicit bool mask, one softmax. Imports torch and the
argument checks only, never a fast path (tests/ops/test_references_independent.py).
A query row whose keys are all masked returns zeros (never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops._checks import check_qkv


def allowed_keys(
    batch: int, num_queries: int, key_mask: Tensor | None, causal: bool, device: torch.device
) -> Tensor | None:
    """Bool [B, 1, Tq, Tk] of the keys each query may read, or None when every key is allowed."""
    if key_mask is None and not causal:
        return None
    num_keys = num_queries if key_mask is None else key_mask.shape[1]
    allowed = torch.ones(1, 1, num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed.expand(batch, 1, num_queries, num_keys)


def masked_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, scale: float | None = None
) -> Tensor:
    """softmax(q kᵀ · scale) v with a bool `allowed` mask, written the obvious way.

    Works for any leading axes; rows with no allowed key return zeros. This is the reference that
    every masked-softmax fast path in routeformer is compared with.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if allowed is None:
        return scores.softmax(dim=-1) @ v
    allowed = allowed.expand(scores.shape)
    has_key = allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.where(has_key, scores, torch.zeros_like(scores)).softmax(dim=-1)
    return (weights * has_key) @ v


def full_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The specification of `full_attention`: dense scores, explicit mask, softmax."""
    check_qkv(q, k, v, mask, causal=causal)
    allowed = allowed_keys(q.shape[0], q.shape[2], mask, causal, q.device)
    return masked_attention_reference(q, k, v, allowed, scale)
