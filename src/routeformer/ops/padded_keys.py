"""Softmax attention under a key-padding mask in O(T) extra memory (the fast paths of `full`).

Axes: B batch, H heads, Tq queries, Tk keys, d head dim, e value dim, w widened head dim.

A dense [B, 1, Tq, Tk] mask costs T² memory (T = 8192: 64 MiB as bool, and SDPA's CPU kernel then
reads it whole) — the form a padding mask used to take. Here:

- bidirectional: SDPA with the key mask as a broadcast [B, 1, 1, Tk] bool mask; the fused CPU kernel
  reads it through its strides, O(T) (measured: 11.7 MiB vs 10.6 without a mask at T = 8192,
  B = 1, H = 4, d = 64; forward + backward 46.8 vs 45.9).
- causal: SDPA accepts no mask together with `is_causal`, and causal & padding as one mask is T×T.
  So the padding goes into the scores through one extra head dimension: q' = [q, 1, 0…],
  k' = [k, b_j, 0…] with b_j = 0 for a real key and a large negative for a padded one, so
  q'·k' = q·k + b_j exactly, and the causal kernel runs unchanged. The CPU flash kernel needs one
  head size for q, k and v (otherwise SDPA falls back to its T² math path), so v is widened with
  zeros too; widths are rounded up to a multiple of 8 (odd head sizes run slower). Cost: copies of
  q, k, v (O(T·w)) and w/d more score work (72/64 at d = 64).

A query with no allowed key returns zeros (never NaN), as `full_attention_reference` specifies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops.attention_lse import masked_bias


def bidirectional_padded_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None
) -> Tensor:
    """softmax(q kᵀ·scale) v over the real keys (`mask` [B, Tk], True = real) of each sequence."""
    has_key = mask.any(dim=1)  # [B]: a sequence with no real key returns zeros
    allowed = (mask | ~has_key[:, None])[:, None, None, :]  # [B, 1, 1, Tk]: broadcast, O(T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out * has_key[:, None, None, None].to(out.dtype)


def widened_width(head_dim: int, value_dim: int) -> int:
    """Head size w of the widened q', k', v': room for the bias column, a multiple of 8."""
    width = max(head_dim + 1, value_dim)
    return -(-width // 8) * 8


def causal_padded_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None
) -> Tensor:
    """Causal softmax attention of query i over the real keys j <= i (`mask` [B, T]); see the module
    docstring for the widened head dimension that carries the padding bias."""
    batch, heads, length, dim = q.shape
    kv_heads, value_dim = k.shape[1], v.shape[-1]
    width = widened_width(dim, value_dim)
    scale = dim ** -0.5 if scale is None else scale
    # One column past q's head dim holds 1 in q' and the key's bias in k'; q'·k' = q·k + bias.
    bias = torch.zeros(batch, 1, length, 1, dtype=k.dtype, device=k.device)
    bias = bias.masked_fill(~mask[:, None, :, None], masked_bias(k.dtype)).expand(batch, kv_heads, length, 1)
    rest = width - dim - 1
    q_wide = torch.cat([q, torch.ones_like(q[..., :1]), q.new_zeros(batch, heads, length, rest)], -1)
    k_wide = torch.cat([k, bias, k.new_zeros(batch, kv_heads, length, rest)], -1)
    v_wide = F.pad(v, (0, width - value_dim))
    out = F.scaled_dot_product_attention(q_wide, k_wide, v_wide, is_causal=True, scale=scale,
                                         enable_gqa=heads != kv_heads)
    # Query i has a real key j <= i iff a real token occurs at or before i; others return zeros
    # (their softmax spread evenly over biased keys: finite, then dropped).
    has_key = mask.cumsum(dim=1) > 0  # [B, T]
    return out[..., :value_dim] * has_key[:, None, :, None].to(out.dtype)
