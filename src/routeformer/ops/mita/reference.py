"""MiTA's specifications: `mita_reference`, dense membership masks and one softmax per query over
exactly the pairs ops/mita/op.py's `mita_attention` computes, the twin its tests compare against;
and `landmark_attention_reference`, the landmark stage's (ops/mita/landmarks.py) written densely.
The algorithm is described in ops/mita/op.py's module docstring.

This twin imports no fast path (tests/ops/test_references_independent.py): `DEFAULT_BLOCK` is a
plain copy of ops/mita/op.py's (checked to equal it); `pool_windows` and `chunk_scores` are defined
here and imported by ops/mita/landmarks.py; the argument check and `grid_pool_shape` come from
ops/mita/checks.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_qkv
from routeformer.ops.mita.checks import check_mita_args, grid_pool_shape

DEFAULT_BLOCK = 64  # the causal block length b when none is given (ops/mita/op.py's default)


def pool_windows(lengths: Tensor, windows: int, size: int) -> Tensor:
    """Float [B, windows, size]: row j marks window j of adaptive pooling over the first
    lengths[b] positions (start ⌊j·n/W⌋, end ⌈(j+1)·n/W⌉; windows overlap when n < W)."""
    index = torch.arange(windows, device=lengths.device)
    start = (index[None, :] * lengths[:, None]) // windows
    end = -((-(index[None, :] + 1) * lengths[:, None]) // windows)
    position = torch.arange(size, device=lengths.device)
    return ((position >= start[..., None]) & (position < end[..., None])).float()


def chunk_scores(landmark: Tensor, keys: Tensor, limit: Tensor, key_real: Tensor | None,
                  scale: float) -> Tensor:
    """Scores of landmarks [B, H, c, d] against keys [B, H, S, d]: −inf beyond each limit [B, c]
    and, where `key_real` [B, N] is given, at padded keys."""
    scores = (landmark * scale) @ keys.transpose(-1, -2)
    span = keys.shape[2]
    if key_real is None and bool((limit >= span).all()):
        return scores  # every landmark reads every key of the span: nothing to exclude
    excluded = torch.arange(span, device=keys.device)[None, None, :] >= limit[..., None]
    if key_real is not None:
        excluded = excluded | ~key_real[:, None, :span]
    return scores.masked_fill(excluded[:, None], float("-inf"))


def _membership_reference(real: Tensor, landmarks: int, causal: bool, block: int,
                          grid: tuple[int, int] | None, extra_tokens: int) -> Tensor:
    """Bool [B, E, N]: which real tokens landmark j pools, written on the tokens' ranks among the
    real tokens of their row (so padding anywhere takes no place in the layout)."""
    batch, length = real.shape
    rank = real.long().cumsum(1) - 1
    if causal:
        experts = max(0, -(-length // block) - 1)
        index = torch.arange(experts, device=real.device)
        return real[:, None, :] & (rank[:, None, :] // block == index[None, :, None])
    if grid is not None:  # fixed 2-D windows over the grid positions
        rows, cols = grid_pool_shape(landmarks)
        height, width = (torch.tensor([side], device=real.device) for side in grid)
        row_windows = pool_windows(height, rows, grid[0])[0]  # [rows, h]
        col_windows = pool_windows(width, cols, grid[1])[0]  # [cols, w]
        body = torch.einsum("ah,bw->abhw", row_windows, col_windows).reshape(landmarks, -1) > 0
        return real[:, None, :] & F.pad(body, (extra_tokens, 0))[None]
    pooled = (real.sum(1) - extra_tokens).clamp_min(0)[:, None, None]  # real tokens after the CLS
    index = torch.arange(landmarks, device=real.device)[None, :, None]
    start, end = index * pooled // landmarks, -((-(index + 1) * pooled) // landmarks)
    body_rank = rank[:, None, :] - extra_tokens
    return real[:, None, :] & (body_rank >= start) & (body_rank < end)


def _softmax_or_zero(logits: Tensor) -> Tensor:
    """softmax over the last axis; rows with no finite logit (a padded query, an empty landmark)
    get zeros, and a zero gradient rather than NaN."""
    empty = ~torch.isfinite(logits).any(-1, keepdim=True)
    return logits.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0)


def mita_reference(
    q: Tensor, k: Tensor, v: Tensor, *, landmarks: int = 25, topk: int = 25, route: int = 1,
    shared: bool = True, causal: bool = False, block: int | None = None,
    grid: tuple[int, int] | None = None, extra_tokens: int = 0, mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The specification of `mita_attention`: each query's key set as a dense [N, E + N] logit
    matrix (shared pairs, then every key with log(how many of its routed experts hold it), then,
    causal, its own block's earlier keys), and one plain softmax. Blocks and windows are counted on
    the ranks of the real tokens."""
    check_qkv(q, k, v, mask, causal=True)
    batch, heads, length, dim = q.shape
    check_mita_args(length if batch else 0, landmarks=landmarks, topk=topk, route=route, causal=causal,
                    grid=grid, extra_tokens=extra_tokens, block=block)
    if batch == 0 or length == 0:
        return v * 0
    block = DEFAULT_BLOCK if block is None else block
    scale = dim ** -0.5 if scale is None else scale
    real = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    q, k, v = (t.masked_fill(~real[:, None, :, None], 0.0) for t in (q, k, v))
    member = _membership_reference(real, landmarks, causal, block, grid, extra_tokens)  # [B, E, N]
    weighted = member.to(q.dtype)
    counts = weighted.sum(-1)
    landmark = torch.einsum("ben,bhnd->bhed", weighted, q) / counts.clamp_min(1)[:, None, :, None]
    landmark_valid = counts > 0
    experts = landmark.shape[2]
    rank = real.long().cumsum(1) - 1
    query_block = rank // block  # [B, N]

    landmark_allowed = real[:, None, :].expand(batch, experts, length)
    query_may_use = landmark_valid[:, None, :].expand(batch, length, experts)
    if causal:
        expert_index = torch.arange(experts, device=q.device)
        landmark_allowed = landmark_allowed & (query_block[:, None, :] <= expert_index[None, :, None])
        query_may_use = (query_may_use & (expert_index[None, None, :] < query_block[:, :, None])
                         & (expert_index[None, None, :] >= query_block[:, :, None] - landmarks))
    landmark_allowed, query_may_use = landmark_allowed[:, None], query_may_use[:, None]
    scores = (landmark @ k.transpose(-1, -2)) * scale
    masked_scores = scores.masked_fill(~landmark_allowed, float("-inf"))
    landmark_values = _softmax_or_zero(masked_scores) @ v

    # Membership of every key in every expert [B, H, E, N], then per query over its routed experts.
    holds = torch.zeros_like(scores)
    width = min(topk, length)
    if width and experts:
        top = masked_scores.topk(width, dim=-1)
        holds.scatter_(-1, top.indices, torch.isfinite(top.values).to(scores.dtype))
    query_logits = (q @ landmark.transpose(-1, -2)) * scale  # [B, H, N, E]
    routes = min(route, experts, landmarks) if causal else min(route, experts)
    routed = query_logits.masked_fill(~query_may_use, float("-inf")).topk(routes, dim=-1)
    chosen = torch.isfinite(routed.values).to(q.dtype)
    copies = torch.zeros_like(query_logits).scatter_(-1, routed.indices, chosen)
    if width == 0:
        copies = torch.zeros_like(copies)
    multiplicity = copies @ holds  # [B, H, N, N]: how many routed experts of query i hold key n
    if causal:
        same_block = query_block[:, :, None] == query_block[:, None, :]
        own_block = same_block & (rank[:, None, :] <= rank[:, :, None]) & real[:, None, :]
        multiplicity = multiplicity + own_block[:, None].to(q.dtype)

    key_logits = (q @ k.transpose(-1, -2)) * scale + torch.log(multiplicity)
    shared_logits = query_logits.masked_fill(~query_may_use, float("-inf"))
    if not shared:
        shared_logits = torch.full_like(shared_logits, float("-inf"))
    logits = torch.cat([shared_logits, key_logits], dim=-1)
    return _softmax_or_zero(logits) @ torch.cat([landmark_values, v.expand(batch, heads, length, -1)], dim=2)


def landmark_attention_reference(
    landmark: Tensor, k: Tensor, v: Tensor, limit: Tensor, *, topk: int, scale: float,
    key_real: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The specification of `landmark_attention`: dense [E, N] scores, masked softmax, top-K."""
    scores = chunk_scores(landmark, k, limit, key_real, scale)
    weights = torch.nan_to_num(scores.softmax(-1))
    top = scores.topk(min(topk, k.shape[2]), dim=-1)
    return weights @ v, top.indices, torch.isfinite(top.values)
