"""MiTA's landmark stage: pool the landmark queries, then let each landmark attend to the keys.

Axes: B batch, H heads, N length, d head dim (e value dim), E landmarks, K keys per expert, S the
keys one chunk of landmarks reads.

Wen et al. (arXiv 2602.01219), Eqs. 5-8: landmarks L = pooled queries; scores S = L Kᵀ·scale;
expert j = the top-K keys of row j of S (Eq. 7); shared expert values V̂ = softmax(S) V (Eq. 8).

Every function here sees *compacted* inputs: the real tokens of a row come first (n_b of them)
and padding after (ops/mita/op.py moves them there), so "the real keys" of a row are a prefix and
"the keys landmark j may read" are the first `limit[b, j]` keys: n_b in the bidirectional build,
min(n_b, (j + 1)·block) in the causal one (blocks ≤ j only).

`landmark_attention` never holds the [E, N] score matrix: it runs over chunks of landmarks (about
`_CHUNK_ELEMENTS` scores at a time) and its backward recomputes each chunk's scores from the saved
log-sum-exp, as a flash kernel does — memory O(E·d + N·d + chunk), not O(E·N), which matters in
the causal build, where E grows with N (E·N = N²/block). Only public PyTorch ops are used.
Softmax statistics are fp32 whatever the input dtype (the op upcasts before calling in here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops.mita.checks import grid_pool_shape
from routeformer.ops.mita.reference import chunk_scores, pool_windows  # the pooling rule, defined once
from routeformer.ops.native.mita import StreamingTopK

_CHUNK_ELEMENTS = 1 << 22  # scores per chunk of landmarks (over B·H): 16 MiB of fp32


def pool_landmarks(
    q: Tensor, real: Tensor, landmarks: int, *, block: int | None,
    grid: tuple[int, int] | None, extra_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Masked average pooling of compacted queries -> (L [B, H, E, d], valid [B, E]).

    Causal (`block` set): landmark j is the mean of block j's real queries, for the E = ⌈N/b⌉ − 1
    blocks that some query of this input has completed (the last block's landmark serves no query).
    Bidirectional: E = `landmarks` adaptive windows over each row's real tokens after the first
    `extra_tokens` (so the windows do not depend on how much padding follows); with `grid`, 2-D
    windows over the fixed token grid, averaging its real tokens. A landmark whose window holds no
    real token is invalid: no expert, no shared pair. `real` [B, N] bool marks the real tokens
    (a prefix of each row, except with `grid`); padded rows of q must be zeros (ops/mita/op.py).
    """
    batch, heads, length, dim = q.shape
    lengths = real.sum(1)
    real = real.to(q.dtype)
    if block is not None:
        blocks = -(-length // block)
        experts = blocks - 1
        pad = blocks * block - length
        sums = F.pad(q, (0, 0, 0, pad)).view(batch, heads, blocks, block, dim)[:, :, :experts].sum(3)
        counts = F.pad(real, (0, pad)).view(batch, blocks, block)[:, :experts].sum(2)
    elif grid is None and (length - extra_tokens) % landmarks == 0 and bool((lengths == length).all()):
        # No padding and windows of equal width: plain window sums of a view (the membership
        # product below would cost E·N·d multiply-adds for N·d additions).
        width = (length - extra_tokens) // landmarks
        sums = q[:, :, extra_tokens:].reshape(batch, heads, landmarks, width, dim).sum(3)
        counts = torch.full((batch, landmarks), float(width), dtype=q.dtype, device=q.device)
    elif grid is None:
        member = pool_windows((lengths - extra_tokens).clamp_min(0), landmarks, length - extra_tokens)
        member = F.pad(member, (extra_tokens, 0))  # [B, E, N]
        sums = torch.einsum("ben,bhnd->bhed", member.to(q.dtype), q)
        counts = member.sum(-1)
    else:
        # Window means of the zero-padded queries over window means of the real indicator: the
        # ratio is the mean over the window's real tokens.
        shape = grid_pool_shape(landmarks)
        body = q[:, :, extra_tokens:].flatten(0, 1).transpose(1, 2).reshape(batch * heads, dim, *grid)
        sums = F.adaptive_avg_pool2d(body, shape).flatten(2).transpose(1, 2)
        sums = sums.reshape(batch, heads, landmarks, dim)
        counts = F.adaptive_avg_pool2d(real[:, extra_tokens:].reshape(batch, 1, *grid), shape).flatten(1)
        return sums / counts.clamp_min(1e-12)[:, None, :, None], counts > 0
    valid = counts > 0
    # Sums of the real queries over their count: the mean over the window's real tokens.
    return sums / counts.clamp_min(1)[:, None, :, None], valid


def landmark_key_limit(lengths: Tensor, experts: int, block: int | None) -> Tensor:
    """Long [B, E]: how many leading (compacted) keys landmark j reads — the real ones, and in the
    causal build only those of blocks ≤ j."""
    limit = lengths[:, None].expand(-1, experts)
    if block is not None:
        ends = (torch.arange(experts, device=lengths.device) + 1) * block
        limit = torch.minimum(limit, ends[None, :])
    return limit


def landmark_pairs(limit: Tensor, per_row: int) -> int:
    """(landmark, key) score pairs `landmark_attention` computes per (b, h): the executed work."""
    return sum((end - first) * span for first, end, span in _chunks(limit, limit.shape[1], per_row))


def _chunks(limit: Tensor, experts: int, per_row: int) -> list[tuple[int, int, int]]:
    """(first, end, span) of each chunk of landmarks; span = keys any of them reads."""
    size = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    spans = limit.amax(0).tolist() if limit.numel() else []
    return [(start, min(experts, start + size), int(max(spans[start:start + size])))
            for start in range(0, experts, size)]


_KEY_BLOCK = 4096  # keys per step of `_every_key_forward`: [E, 4096] scores, cache-sized for E = 64


def _every_key_forward(landmark: Tensor, k: Tensor, v: Tensor, scale: float, width: int):
    """(V̂, lse, top-K indices, their validity) when every landmark reads every key (the
    bidirectional build without padding). Why a second forward: `landmark · Kᵀ` is an [E, d] x
    [d, N] product, a shape BLAS runs at a third of its rate, and its [E, N] result is a fresh
    allocation per chunk. Here the keys go in blocks of `_KEY_BLOCK` as `K_blk · Lᵀ` ([S, d] x
    [d, E], the fast shape), with an online softmax over the blocks (running max and sum, as a
    flash kernel) and V̂ accumulated by `P_blkᵀ V_blk`; the scores are kept, transposed into one
    [E, N] buffer, only for the top-K selection (a row-wise top-K over N is several times faster
    than per-block top-Ks merged). Memory O(E·N) for that buffer: linear in N, as E is fixed here."""
    batch, heads, experts, _ = landmark.shape
    length = k.shape[2]
    scaled_t = (landmark * scale).transpose(-1, -2)  # [B, H, d, E]
    selector = StreamingTopK.make(landmark, batch * heads, experts, width) if width else None
    scores = landmark.new_empty(batch, heads, experts, length) if width and selector is None else None
    row_max = landmark.new_full((batch, heads, 1, experts), float("-inf"))
    total = landmark.new_zeros(batch, heads, 1, experts)
    acc = landmark.new_zeros(batch, heads, experts, v.shape[-1])
    for lo in range(0, length, _KEY_BLOCK):
        hi = min(length, lo + _KEY_BLOCK)
        block_t = k[:, :, lo:hi] @ scaled_t  # [B, H, S, E]
        if selector is not None:
            selector.update(block_t, lo)
        elif scores is not None:
            scores[..., lo:hi] = block_t.transpose(-1, -2)
        new_max = torch.maximum(row_max, block_t.amax(dim=-2, keepdim=True))
        correction = torch.exp(row_max - new_max)  # 0 on the first block (exp(-inf))
        weights = block_t.sub_(new_max).exp_()
        total = total * correction + weights.sum(dim=-2, keepdim=True)
        acc = acc * correction.transpose(-1, -2) + weights.transpose(-1, -2) @ v[:, :, lo:hi]
        row_max = new_max
    out = acc / total.transpose(-1, -2)
    lse = (row_max + total.log())[:, :, 0]
    if not width:
        empty = torch.zeros(batch, heads, experts, 0, dtype=torch.long, device=k.device)
        return out, lse, empty, empty.bool()
    if selector is not None:
        index = selector.indices((batch, heads, experts))
    else:
        index = scores.topk(width, dim=-1).indices
    return out, lse, index, torch.ones_like(index, dtype=torch.bool)


class _LandmarkAttention(torch.autograd.Function):
    """softmax(L Kᵀ·scale, keys < limit) V by chunks of landmarks; also the top-K key indices."""

    @staticmethod
    def forward(ctx, landmark, k, v, limit, key_real, scale, topk):
        batch, heads, experts, _ = landmark.shape
        length = k.shape[2]
        out = landmark.new_zeros(batch, heads, experts, v.shape[-1])
        lse = landmark.new_zeros(batch, heads, experts)
        width = min(topk, length)
        top_index = torch.zeros(batch, heads, experts, width, dtype=torch.long, device=k.device)
        top_valid = torch.zeros(batch, heads, experts, width, dtype=torch.bool, device=k.device)
        chunks = _chunks(limit, experts, batch * heads * length)
        every_key = key_real is None and length > 0 and bool((limit >= length).all())
        if every_key:
            out, lse, top_index, top_valid = _every_key_forward(landmark, k, v, scale, width)
            chunks = []  # the loop below has nothing left to do
        for first, end, span in chunks:
            if span == 0:
                continue
            scores = chunk_scores(landmark[:, :, first:end], k[:, :, :span], limit[:, first:end], key_real,
                                   scale)
            if width:
                top = scores.topk(min(width, span), dim=-1)
                top_index[:, :, first:end, :top.indices.shape[-1]] = top.indices
                top_valid[:, :, first:end, :top.indices.shape[-1]] = torch.isfinite(top.values)
            # softmax in place on the chunk (one temporary of its size, not three): shift by the
            # row maximum, exponentiate, normalise after the product with V.
            row_max = scores.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # a row reading nothing
            weights = scores.sub_(row_max).exp_()
            total = weights.sum(dim=-1, keepdim=True)
            out[:, :, first:end] = (weights @ v[:, :, :span]) / total.clamp_min(torch.finfo(total.dtype).tiny)
            # lse of a row reading nothing: 0 (its weights are all 0, so its backward adds nothing).
            lse[:, :, first:end] = torch.where(total > 0, row_max + total.log(), 0.0)[..., 0]
        ctx.save_for_backward(landmark, k, v, limit, out, lse)
        ctx.key_real, ctx.scale = key_real, scale
        ctx.chunks = _chunks(limit, experts, batch * heads * length) if every_key else chunks
        ctx.mark_non_differentiable(top_index, top_valid)
        return out, top_index, top_valid

    @staticmethod
    def backward(ctx, grad_out, _grad_index, _grad_valid):
        landmark, k, v, limit, out, lse = ctx.saved_tensors
        scale = ctx.scale
        grad_landmark, grad_k, grad_v = torch.zeros_like(landmark), torch.zeros_like(k), torch.zeros_like(v)
        # D = rowsum(dO ∘ O): the softmax backward's correction, once for all chunks.
        correction = (grad_out * out).sum(-1, keepdim=True)
        for first, end, span in ctx.chunks:
            if span == 0:
                continue
            rows = slice(first, end)
            scores = chunk_scores(landmark[:, :, rows], k[:, :, :span], limit[:, rows], ctx.key_real, scale)
            probs = torch.exp(scores - lse[:, :, rows, None])
            grad_v[:, :, :span] += probs.transpose(-1, -2) @ grad_out[:, :, rows]
            grad_scores = probs * (grad_out[:, :, rows] @ v[:, :, :span].transpose(-1, -2)
                                   - correction[:, :, rows])
            grad_landmark[:, :, rows] = (grad_scores @ k[:, :, :span]) * scale
            grad_k[:, :, :span] += (grad_scores.transpose(-1, -2) @ landmark[:, :, rows]) * scale
        return grad_landmark, grad_k, grad_v, None, None, None, None


def landmark_attention(
    landmark: Tensor, k: Tensor, v: Tensor, limit: Tensor, *, topk: int, scale: float,
    key_real: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(V̂ [B, H, E, e], top-K key indices [B, H, E, K'], their validity [B, H, E, K']) for landmarks
    [B, H, E, d] reading the first limit[b, j] keys of k, v [B, H, N, d|e] (and, with `key_real`
    [B, N], only real ones: the grid case, whose padding is not compacted); K' = min(K, N).

    Eqs. 7-8: expert j = the top-K keys of S_j = L_j Kᵀ·scale among those it may read (fewer when
    it may read fewer than K: the rest are marked invalid); V̂_j = softmax(S_j) V. A landmark that
    reads no key gets V̂ = 0 (it is invalid and never used)."""
    return _LandmarkAttention.apply(landmark, k, v, limit, key_real, scale, topk)
