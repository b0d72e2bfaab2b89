"""Sliding-window attention (the `local` expert), blockwise.

Axes: B batch, H heads, T length, d head dim, N blocks, w window (= block size).

Causal: token i reads keys [i - window + 1, i]. Non-causal: keys [i - window, i + window].
Fast path: cut the (internally padded) sequence into N blocks of `window` tokens; every query block
attends to its own block and the previous one (causal) or both neighbours (non-causal), with a
band mask, through `block_attention`. Time and memory O(T·window·d).
Reference: the dense T×T score matrix with the band mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.block_attention import block_attention
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.full import masked_attention_reference


def _in_window(offset: Tensor, window: int, causal: bool) -> Tensor:
    """offset = key position - query position -> bool: the key lies in the query's window."""
    if causal:
        return (offset <= 0) & (offset > -window)
    return offset.abs() <= window


def _neighbour_blocks(x: Tensor, window: int, blocks: int, causal: bool) -> Tensor:
    """[B, H, N·w, d] (already padded to N·w) -> [B, H, N, (2 or 3)·w, d]: prev (, next) + own."""
    batch, heads, _, dim = x.shape
    padded = F.pad(x, (0, 0, window, 0 if causal else window))
    parts = [padded[:, :, : blocks * window], padded[:, :, window : window + blocks * window]]
    if not causal:
        parts.append(padded[:, :, 2 * window :])
    return torch.cat([p.reshape(batch, heads, blocks, window, dim) for p in parts], dim=3)


def _neighbour_key_mask(valid: Tensor, window: int, blocks: int, causal: bool) -> Tensor:
    """Bool [B, T'] of real keys -> [B, N, (2 or 3)·w] in the layout of `_neighbour_blocks`."""
    padded = F.pad(valid, (window, 0 if causal else window), value=False)
    parts = [padded[:, : blocks * window], padded[:, window : window + blocks * window]]
    if not causal:
        parts.append(padded[:, 2 * window :])
    return torch.cat([p.reshape(valid.shape[0], blocks, window) for p in parts], dim=2)


def _band(window: int, causal: bool, device: torch.device) -> Tensor:
    """Bool [w, (2 or 3)·w]: query a of a block may read key b of the neighbour layout.

    Key b sits at offset b - w from the block start, so its distance to query a is b - w - a.
    """
    query = torch.arange(window, device=device)[:, None]
    key = torch.arange((2 if causal else 3) * window, device=device)[None, :]
    return _in_window(key - window - query, window, causal)


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, *, window: int, mask: Tensor | None = None,
    causal: bool = False, scale: float | None = None,
) -> Tensor:
    """Blockwise sliding-window softmax attention; see the module docstring."""
    check_qkv(q, k, v, mask, causal=True)  # a window needs queries and keys on one axis
    check_positive("window", window)
    batch, heads, length, _ = q.shape
    blocks = -(-length // window)
    pad = blocks * window - length
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        valid = F.pad(valid, (0, pad), value=False)
    key_valid = _neighbour_key_mask(valid, window, blocks, causal)  # [B, N, Lk]
    allowed = _band(window, causal, q.device)[None, None] & key_valid[:, None, :, None, :]
    out = block_attention(
        q.reshape(batch, heads, blocks, window, -1),
        _neighbour_blocks(k, window, blocks, causal),
        _neighbour_blocks(v, window, blocks, causal),
        allowed,  # [B, 1, N, w, Lk]
        scale,
    )
    return out.reshape(batch, heads, blocks * window, -1)[:, :, :length]


def local_band(length: int, window: int, causal: bool, device: torch.device) -> Tensor:
    """Bool [T, T]: key j is inside query i's window."""
    positions = torch.arange(length, device=device)
    return _in_window(positions[None, :] - positions[:, None], window, causal)


def local_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, window: int, mask: Tensor | None = None,
    causal: bool = False, scale: float | None = None,
) -> Tensor:
    """The specification of `local_attention`: dense scores with a band mask."""
    check_qkv(q, k, v, mask, causal=True)
    check_positive("window", window)
    batch, _, length, _ = q.shape
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    allowed = local_band(length, window, causal, q.device)[None, None] & valid[:, None, None, :]
    return masked_attention_reference(q, k, v, allowed, scale)


def local_attention_flops(
    batch: int, heads: int, length: int, head_dim: int, window: int, causal: bool
) -> int:
    """Executed FLOPs of the blockwise path: every block scores (2 or 3)·w keys per query."""
    blocks = -(-length // window)
    keys_per_query = (2 if causal else 3) * window
    return batch * heads * dense_attention_flops(blocks * window * keys_per_query, head_dim)
