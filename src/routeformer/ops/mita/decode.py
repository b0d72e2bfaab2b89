"""Cached (incremental) decoding of causal MiTA: the streaming layout's state and the outputs of new
tokens, equal to the rows of the parallel op (ops/mita/op.py: `mita_attention(causal=True)`).

Axes: B batch, H heads, G key/value heads, t new tokens, L keys so far, d head dim (e value dim),
E completed blocks, K keys per expert, R routed experts per query, M landmark window, S keys one query reads.

The streaming layout (see ops/mita/op.py) makes this possible: blocks of `block` = b tokens; landmark j
(the mean query of block j), its shared value V̂_j and its expert (top-K keys) are fixed once block
j is complete — they read keys < (j + 1)·b only. So the state is

    k, v              [B, G, L, d|e]  every key so far (a completed block's landmark reads them all;
                                      G K/V heads, G dividing H: query head h reads head h // (H/G))
    block_q           [B, H, r, d]    the queries of the incomplete block (r < b)
    landmark          [B, H, E, d]    landmarks of the completed blocks
    landmark_values   [B, H, E, e]    their shared values V̂ (Eq. 8)
    expert_index      [B, H, E, K]    their experts' keys (Eq. 7; index 0 where invalid)
    expert_valid      [B, H, E, K]    False where block j had fewer than K keys before its end

and a new token at index i of block c reads, under one softmax (Eqs. 9-10), the shared pairs of
the window of landmarks c − M .. c − 1, the K keys of each of its top-R experts in that window (by
q·L, the shared expert's logits), and the keys of its own block up to i. New tokens are taken block
segment by block segment; a segment that completes its block computes that block's landmark.
Scores, softmax and means are fp32 (as in the parallel op). No padding: every token is real.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.decode import append_keys_values
from routeformer.ops.grouped_heads import repeat_kv


def _complete_block(cache: dict, block: int, topk: int, scale: float) -> None:
    """Landmark, shared value and expert of the block just completed (its queries in block_q)."""
    heads = cache["block_q"].shape[1]
    # all keys < (j + 1)·b: the block's end; K/V heads repeated for their query heads (GQA)
    keys, values = repeat_kv(cache["k"].float(), heads), repeat_kv(cache["v"].float(), heads)
    landmark = cache["block_q"].float().sum(2, keepdim=True) / block  # [B, H, 1, d]
    scores = (landmark * scale) @ keys.transpose(-1, -2)  # [B, H, 1, L]
    landmark_values = scores.softmax(-1) @ values
    width = min(topk, keys.shape[2])
    index = scores.topk(width, dim=-1).indices if width else scores.new_zeros(*scores.shape[:3], 0).long()
    valid = torch.ones_like(index, dtype=torch.bool)
    if width < topk:  # fewer keys before the block's end than the expert's width
        index = torch.cat([index, index.new_zeros(*index.shape[:3], topk - width)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(*valid.shape[:3], topk - width)], dim=-1)
    for name, new in (("landmark", landmark), ("landmark_values", landmark_values),
                      ("expert_index", index), ("expert_valid", valid)):
        cache[name] = new if name not in cache else torch.cat([cache[name], new], dim=2)
    cache["block_q"] = cache["block_q"][:, :, :0]


def _segment(q: Tensor, first: int, cache: dict, *, landmarks: int, topk: int, route: int,
             shared: bool, block: int, scale: float) -> Tensor:
    """Outputs [B, H, t, e] of the new queries q [B, H, t, d] of indices first.. (one block c)."""
    batch, heads, count, _ = q.shape
    q = q.float()
    current = first // block
    keys, values = repeat_kv(cache["k"].float(), heads), repeat_kv(cache["v"].float(), heads)
    # Own block, exact and causal: keys c·b .. i.
    own = slice(current * block, first + count)
    local_keys, local_values = keys[:, :, own], values[:, :, own]
    local_logits = (q * scale) @ local_keys.transpose(-1, -2)  # [B, H, t, b']
    key_index = torch.arange(current * block, first + count, device=q.device)
    query_index = torch.arange(first, first + count, device=q.device)
    local_logits = local_logits.masked_fill(key_index[None, :] > query_index[:, None], float("-inf"))
    logits, value_parts = [local_logits], [local_values[:, :, None].expand(-1, -1, count, -1, -1)]

    low = max(0, current - landmarks)  # the window of completed blocks' landmarks
    if current > low:
        window = cache["landmark"][:, :, low:current]  # [B, H, M, d]
        shared_logits = (q * scale) @ window.transpose(-1, -2)  # [B, H, t, M]
        if shared:
            logits.append(shared_logits)
            window_values = cache["landmark_values"][:, :, None, low:current]
            value_parts.append(window_values.expand(-1, -1, count, -1, -1))
        if topk:
            chosen = shared_logits.topk(min(route, current - low), dim=-1).indices + low  # [B, H, t, R]
            index = cache["expert_index"][:, :, None].expand(-1, -1, count, -1, -1).gather(
                3, chosen[..., None].expand(-1, -1, -1, -1, topk)).flatten(3)  # [B, H, t, R·K]
            valid = cache["expert_valid"][:, :, None].expand(-1, -1, count, -1, -1).gather(
                3, chosen[..., None].expand(-1, -1, -1, -1, topk)).flatten(3)
            flat = index.flatten(2)[..., None]
            routed_keys = keys.gather(2, flat.expand(-1, -1, -1, keys.shape[-1])).view(*index.shape, -1)
            routed_values = values.gather(2, flat.expand(-1, -1, -1, values.shape[-1])).view(*index.shape, -1)
            routed_logits = ((q[:, :, :, None] * scale) * routed_keys).sum(-1)
            logits.append(routed_logits.masked_fill(~valid, float("-inf")))
            value_parts.append(routed_values)
    # One softmax over the concatenation [own block; shared pairs; routed pairs] (Eq. 10).
    weights = torch.cat(logits, dim=-1).softmax(-1)
    return (weights[..., None] * torch.cat(value_parts, dim=3)).sum(3)


def mita_decode(
    q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict, *, landmarks: int, topk: int,
    route: int, shared: bool, block: int, scale: float | None = None,
) -> Tensor:
    """Outputs [B, H, t, e] of the new tokens q [B, H, t, d], k, v [B, G, t, d|e] of indices
    start.. of a stream whose earlier tokens `cache` holds (start with {}): the parallel causal op's
    rows. G < H (grouped-query attention, G dividing H): the cache holds G K/V heads and query head h
    reads K/V head h // (H / G); each step repeats the cached K/V for the query heads (a copy)."""
    if torch.is_autocast_enabled(q.device.type):  # fp32 inside, as the parallel op (ops/mita/op.py)
        with torch.autocast(q.device.type, enabled=False):
            return mita_decode(q, k, v, start, cache, landmarks=landmarks, topk=topk, route=route,
                               shared=shared, block=block, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if "block_q" not in cache:
        cache["block_q"] = q[:, :, :0]
    outs, offset = [], 0
    while offset < q.shape[2]:
        first = start + offset
        end = min(start + q.shape[2], (first // block + 1) * block)  # the rest of this block
        part = slice(offset, offset + end - first)
        append_keys_values(cache, k[:, :, part], v[:, :, part])
        cache["block_q"] = torch.cat([cache["block_q"], q[:, :, part]], dim=2)
        outs.append(_segment(q[:, :, part], first, cache, landmarks=landmarks, topk=topk, route=route,
                             shared=shared, block=block, scale=scale))
        if end % block == 0:
            _complete_block(cache, block, topk, scale)
        offset += end - first
    return torch.cat(outs, dim=2).to(q.dtype)
