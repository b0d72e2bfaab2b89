"""Full softmax attention (the `full` expert): the fast path and its FLOP count.

Axes: B batch, H heads, T length (Tq queries, Tk keys), d head dim.
Fast path: `scaled_dot_product_attention`, under a padding mask in O(T) extra memory
(ops/padded_keys.py). Reference (ops/full/reference.py): explicit masked softmax.
A query row whose keys are all masked returns zeros (never NaN), in both.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_qkv
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.padded_keys import (
    bidirectional_padded_attention,
    causal_padded_attention,
    widened_width,
)


def full_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax(q kᵀ · scale + mask) v over q [B, H, T, d] and k, v [B, G, T, d].

    `mask` is a bool key-padding mask [B, Tk] (True = real token); `causal` lets query i read keys
    j <= i. Rows left with no key return zeros. G < H (grouped-query attention, G dividing H):
    query head h reads K/V head h // (H / G), through SDPA's `enable_gqa` (no K/V copy here).
    """
    check_qkv(q, k, v, mask, causal=causal, grouped=True)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    # O(T) memory under a padding mask, never a dense [B, 1, Tq, Tk] one (ops/padded_keys.py).
    if causal:
        return causal_padded_attention(q, k, v, mask, scale)
    return bidirectional_padded_attention(q, k, v, mask, scale)


def sdpa_allowed(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float | None = None) -> Tensor:
    """SDPA with a bool `allowed` mask [B, 1, Tq, Tk]; rows with no allowed key return zeros."""
    has_key = allowed.any(dim=-1, keepdim=True)  # [B, 1, Tq, 1]
    # Empty rows get every key (so no kernel ever sees an all -inf row), then are zeroed.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key, scale=scale)
    return out * has_key.to(out.dtype)


def full_attention_flops(
    batch: int, heads: int, num_queries: int, num_keys: int, head_dim: int, causal: bool,
    masked: bool = False,
) -> int:
    """Executed FLOPs of `full_attention`.

    The fused causal kernel skips the upper triangle (T(T+1)/2 pairs); under a padding mask
    (`masked`) it runs on q, k, v widened to `widened_width` (the bias column, ops/padded_keys.py).
    Bidirectional attention scores every pair.
    """
    if not causal:
        return batch * heads * dense_attention_flops(num_queries * num_keys, head_dim)
    pairs = num_queries * (num_queries + 1) // 2
    width = widened_width(head_dim, head_dim) if masked else head_dim
    return batch * heads * dense_attention_flops(pairs, width)
