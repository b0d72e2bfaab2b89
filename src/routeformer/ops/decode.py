"""Incremental (cached) decoding primitives: attention of t new queries over cached keys.

Axes: B batch, H heads, t new tokens, L cached + new keys, d head dim.

Indices are token counts, not positional encodings: the n-th token of the stream has index n,
whatever position its rotary angle or embedding uses (meta-tokens may zero it). A query of index i
reads the keys of index j <= i (and, with a window w, i - j < w) — the causal rule of the parallel
layers, so decoding token by token gives the parallel forward pass's outputs.

The reference these are tested against is the parallel layer itself (tests/models/test_cache.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def append_keys_values(cache: dict, k: Tensor, v: Tensor, prefix: str = "") -> tuple[Tensor, Tensor, int]:
    """Append the new k, v [B, H, t, d] to `cache[prefix + "k"/"v"]`; return every cached key and
    value (old + new) and the index of the first one (`prefix + "start"`, 0 until trimmed)."""
    if prefix + "k" in cache:
        k = torch.cat([cache[prefix + "k"], k], dim=2)
        v = torch.cat([cache[prefix + "v"], v], dim=2)
    cache[prefix + "k"], cache[prefix + "v"] = k, v
    return k, v, cache.get(prefix + "start", 0)


def trim_keys_values(cache: dict, keep: int, prefix: str = "") -> None:
    """Drop all but the last `keep` cached keys/values (a window never reads further back)."""
    k = cache[prefix + "k"]
    drop = max(0, k.shape[2] - keep)
    if drop:
        cache[prefix + "k"], cache[prefix + "v"] = k[:, :, drop:], cache[prefix + "v"][:, :, drop:]
        cache[prefix + "start"] = cache.get(prefix + "start", 0) + drop


def allowed_cached(query_index: Tensor, key_index: Tensor, window: int | None = None) -> Tensor:
    """bool [t, L]: key j may be read by query i (j <= i, and i - j < window if a window is set)."""
    distance = query_index[:, None] - key_index[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def cached_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, query_start: int, key_start: int, window: int | None = None,
) -> Tensor:
    """softmax(q kᵀ / sqrt(d)) v for q [B, H, t, d] of indices query_start.. over k, v [B, H, L, d]
    of indices key_start.., under the causal (and window) rule."""
    if window is None and query_start == key_start and q.shape[2] == k.shape[2]:
        # A prefill (the queries are all the keys): SDPA's causal kernel, no T×T mask built.
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
    device = q.device
    query_index = torch.arange(query_start, query_start + q.shape[2], device=device)
    key_index = torch.arange(key_start, key_start + k.shape[2], device=device)
    allowed = allowed_cached(query_index, key_index, window)
    if bool(allowed.all()):
        return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def start_linear_state(phi_k: Tensor, v: Tensor, cache: dict) -> None:
    """The running state after a prefill computed by the chunked parallel op."""
    cache["state"] = phi_k.transpose(-1, -2) @ v
    cache["normaliser"] = phi_k.sum(dim=2)


def advance_linear_state(phi_k: Tensor, v: Tensor, cache: dict) -> None:
    """Add t new tokens to the running state (started at zero) without reading it: for a step
    whose tokens do not query this attention (meta's hard routing elsewhere) but whose keys later
    tokens will read."""
    if "state" not in cache:
        start_linear_state(phi_k, v, cache)
        return
    cache["state"] = cache["state"] + phi_k.transpose(-1, -2) @ v
    cache["normaliser"] = cache["normaliser"] + phi_k.sum(dim=2)


def linear_attention_step(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, cache: dict, eps: float,
) -> Tensor:
    """Causal linear attention of t new tokens given the running state in `cache` (S = Σ φ(k) vᵀ
    [B, H, d, e] and z = Σ φ(k) [B, H, d] over earlier tokens), which it then advances:

        out_i = φ(q_i)·(S + Σ_{j<=i new} φ(k_j) v_jᵀ) / (φ(q_i)·(z + Σ_{j<=i new} φ(k_j)) + eps).
    """
    batch, heads, length, dim = phi_q.shape
    state = cache.get("state", phi_q.new_zeros(batch, heads, dim, v.shape[-1]))
    normaliser = cache.get("normaliser", phi_q.new_zeros(batch, heads, dim))
    scores = (phi_q @ phi_k.transpose(-1, -2)).tril()  # [B, H, t, t]: the new tokens among themselves
    numerator = phi_q @ state + scores @ v
    denominator = (phi_q * normaliser[:, :, None]).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
    cache["state"] = state + phi_k.transpose(-1, -2) @ v
    cache["normaliser"] = normaliser + phi_k.sum(dim=2)
    return numerator / (denominator + eps)
