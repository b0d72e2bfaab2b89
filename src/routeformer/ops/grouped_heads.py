"""Grouped-query attention (GQA): fewer key/value heads than query heads.

Axes: B batch, H query heads, G key/value heads (H = G·g), g query heads per group, T length,
d head dim. Query head h reads key/value head h // g.

- `repeat_kv`: k or v [B, G, T, d] -> [B, H, T, d], each K/V head repeated for its g query heads;
  a copy (the identity when G = H). For the ops that need equal head counts.
- `group_queries` / `ungroup_queries`: q [B, H, T, d] <-> [B, G, g·T, d]. An op whose rows are
  independent given their keys (attention over per-row key indices: the causal rule lives in the
  indices) runs one call over the group's K/V this way, without copying K/V per query head.
"""

from __future__ import annotations

from torch import Tensor


def check_kv_heads(heads: int, kv_heads: int) -> None:
    """Raise ValueError unless `kv_heads` is a positive integer dividing `heads`."""
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1:
        raise ValueError(f"kv_heads must be a positive integer; got {kv_heads!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads}): query head h reads "
                         "key/value head h // (heads // kv_heads)")


def query_group(q: Tensor, k: Tensor) -> int:
    """g = H / G for q [B, H, ...] and k [B, G, ...] (ValueError unless G divides H)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"the key/value heads ({kv_heads}) must divide the query heads ({heads}); "
                         f"got q={tuple(q.shape)}, k={tuple(k.shape)}")
    return heads // kv_heads


def repeat_kv(t: Tensor, heads: int) -> Tensor:
    """t [B, G, ...] -> [B, heads, ...]: K/V head h // (heads / G) for query head h (a copy
    unless G = heads)."""
    kv_heads = t.shape[1]
    if kv_heads == heads:
        return t
    return t.repeat_interleave(heads // kv_heads, dim=1)


def group_queries(q: Tensor, kv_heads: int) -> Tensor:
    """q [B, H, T, ...] -> [B, G, g·T, ...] (row r of group j: query head j·g + r // T, token r % T)."""
    batch, heads = q.shape[:2]
    return q.reshape(batch, kv_heads, (heads // kv_heads) * q.shape[2], *q.shape[3:])


def ungroup_queries(t: Tensor, heads: int) -> Tensor:
    """The inverse of `group_queries`: [B, G, g·T, ...] -> [B, H, T, ...]."""
    batch, kv_heads = t.shape[:2]
    return t.reshape(batch, heads, t.shape[2] // (heads // kv_heads), *t.shape[3:])


def spread_heads(t: Tensor, heads: int) -> Tensor:
    """t [B, R, ...] with R = 1, G (dividing heads) or heads -> [B, heads, ...]: a broadcast view
    when R = 1, t itself when R = heads, else each head repeated for its group (a copy; for small
    per-head tensors such as routing indices)."""
    if t.shape[1] == heads:
        return t
    if t.shape[1] == 1:
        return t.expand(t.shape[0], heads, *t.shape[2:])
    return t.repeat_interleave(heads // t.shape[1], dim=1)
