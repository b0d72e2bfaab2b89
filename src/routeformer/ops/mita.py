"""MiTA: compress-and-route attention with landmark queries and top-k deformable experts.

Axes: B batch, H heads, N length, d head dim (e value dim), E experts (= landmarks), K keys per
expert (top-k width), R routed experts per query, P packed query slots per block.

Non-causal (Wen et al., arXiv 2602.01219, Eqs. 5-10, restated in issue 4):
  1. landmarks L [E, d]: the queries average-pooled over E uniformly spaced windows (1-D
     adaptive pooling; 2-D over `grid=(h, w)`); the first `extra_tokens` tokens (a CLS token) are
     left out of the pooling and are otherwise ordinary queries and keys;
  2. scores S = L Kᵀ·scale [E, N]; expert j = the top-K keys/values of landmark j;
  3. shared expert: landmark values V̂ = softmax(S) V; the landmarks are its keys;
  4. routing: each query goes to its top-R experts by q·Lᵀ (the same logits as the shared expert's);
  5. out = softmax over the concatenation [shared expert's E pairs; the R·K routed pairs] (a key in
     two routed experts counts twice, as in the concatenation).
Step 5 runs expert-wise: the (query, expert) pairs are sorted by (batch·head, expert); each
expert's K keys are gathered once (`_gather_experts`) and its queries attend to them together.
- R = 1, non-causal (the paper's configuration): a query's whole key set is [shared E pairs;
  its expert's K pairs], the same for every query of the expert, so one softmax over that
  concatenation does it — per expert one SDPA call on long inputs (the fused kernel's online
  softmax is the log-sum-exp merge), batched packs of P queries on short ones.
- Otherwise (R > 1, causal): each part — shared expert, each routed slot, the causal own block —
  returns its output with its log-sum-exp (`ops.attention_lse`, a fused kernel on CPU), and
  `merge_partials` combines them by the online-softmax rule.
Nothing of size N×N exists: cost O(N·(E + R·K)·d + E·N·d).

Causal (ours; for language models). The sequence is cut into E blocks of b = ceil(N / E) tokens;
landmark j pools the queries of block j. A query in block i reads

      keys:      block 0     block 1     block 2     block 3 (i = 3)
    shared:      L0,V̂0       L1,V̂1       L2,V̂2        ·            landmarks of blocks j < i
    routed:      top-R of experts 0..2, expert j = top-K keys of blocks ≤ j
    local:                                           k₃₀ .. k_t   exact causal, own block only

so landmark j and expert j only ever contain queries and keys from positions < (j + 1)·b ≤ i·b,
all before the query; the query's own block is attended exactly. Block 0 reads only itself.
Cost O(N·(b + E + R·K)·d + E·N·d): with E fixed the local term grows as N²/E.

`mita_reference` builds the same key set per query as a dense [N, E + N] logit matrix (a key
held by c routed experts gets log c added) and applies one plain softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.attention_lse import MASKED, attention_with_lse, merge_partials
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.full import sdpa_allowed
from routeformer.ops.gathered import _flat_rows

# Buckets averaging at least this many packs of queries run one SDPA call each instead of packing.
_LOOP_FACTOR = 4
DEFAULT_PACK = 64  # queries per packed block of one expert (measured: 64-128 fastest at N >= 16k)


@dataclass
class MitaResult:
    out: Tensor  # [B, H, N, e]
    flops: int  # executed attention FLOPs (landmark scores, shared, routed, local)
    expert_load: Tensor  # [E]: fraction of (query, routed slot) pairs each expert received


def grid_pool_shape(landmarks: int) -> tuple[int, int]:
    """The most square (rows, cols) with rows·cols = landmarks: 16 -> (4, 4), 8 -> (2, 4)."""
    rows = math.isqrt(landmarks)
    while landmarks % rows:
        rows -= 1
    return rows, landmarks // rows


def check_mita_args(
    length: int, *, landmarks: int, topk: int, route: int, causal: bool,
    grid: tuple[int, int] | None, extra_tokens: int,
) -> None:
    """Raise ValueError naming the argument when the MiTA settings do not fit a length-N input."""
    check_positive("landmarks", landmarks)
    check_positive("route", route)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise ValueError(f"topk must be an integer >= 0 (0 = no routed experts); got {topk!r}")
    if not isinstance(extra_tokens, int) or extra_tokens < 0:
        raise ValueError(f"extra_tokens must be an integer >= 0; got {extra_tokens!r}")
    if causal and (grid is not None or extra_tokens):
        raise ValueError("the causal variant pools 1-D blocks of the sequence: grid and extra_tokens "
                         "are for non-causal (vision) inputs")
    pooled = length - extra_tokens
    if pooled < 1:
        raise ValueError(f"extra_tokens ({extra_tokens}) leaves no token to pool in a length-{length} input")
    if grid is not None:
        if len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid):
            raise ValueError(f"grid must be a pair of positive integers (h, w); got {grid!r}")
        if grid[0] * grid[1] != pooled:
            raise ValueError(f"grid {tuple(grid)} holds {grid[0] * grid[1]} tokens but the input has "
                             f"{pooled} tokens after {extra_tokens} extra token(s)")
        rows, cols = grid_pool_shape(landmarks)
        if rows > grid[0] or cols > grid[1]:
            raise ValueError(f"landmarks={landmarks} pools to a {rows}x{cols} grid, larger than the "
                             f"{grid[0]}x{grid[1]} token grid")


# -- landmarks ----------------------------------------------------------------------------------
def _pool_windows(length: int, windows: int, device: torch.device) -> Tensor:
    """Float [windows, length]: row j marks the adaptive-pooling window j (start ⌊jL/W⌋, end ⌈(j+1)L/W⌉)."""
    index = torch.arange(windows, device=device)
    start = (index * length) // windows
    end = -((-(index + 1) * length) // windows)
    position = torch.arange(length, device=device)
    return ((position >= start[:, None]) & (position < end[:, None])).float()


def _landmarks(
    q: Tensor, mask: Tensor | None, landmarks: int, causal: bool, grid: tuple[int, int] | None,
    extra_tokens: int,
) -> tuple[Tensor, Tensor, int]:
    """Masked average pooling of the queries -> (L [B, H, E, d], valid [B, E], block length).

    A landmark whose window holds no real token is invalid (no expert, no shared pair).
    """
    batch, heads, length, dim = q.shape
    weights = q.new_ones(batch, length) if mask is None else mask.to(q.dtype)
    if causal:
        block = -(-length // landmarks)
        blocks = -(-length // block)
        pad = blocks * block - length
        padded = F.pad(q if mask is None else q * weights[:, None, :, None], (0, 0, 0, pad))
        sums = padded.view(batch, heads, blocks, block, dim).sum(3)
        counts = F.pad(weights, (0, pad)).view(batch, blocks, block).sum(2)
    else:
        body = q[:, :, extra_tokens:]
        if mask is not None:
            body = body * weights[:, None, extra_tokens:, None]
        body_weights = weights[:, extra_tokens:]
        if grid is None:
            pooled = F.adaptive_avg_pool1d(body.flatten(0, 1).transpose(1, 2), landmarks)
            sums = pooled.transpose(1, 2).reshape(batch, heads, landmarks, dim)
            counts = F.adaptive_avg_pool1d(body_weights[:, None], landmarks)[:, 0]
        else:
            shape = grid_pool_shape(landmarks)
            image = body.flatten(0, 1).transpose(1, 2).reshape(batch * heads, dim, *grid)
            sums = F.adaptive_avg_pool2d(image, shape).flatten(2).transpose(1, 2)
            sums = sums.reshape(batch, heads, landmarks, dim)
            counts = F.adaptive_avg_pool2d(body_weights.view(batch, 1, *grid), shape).flatten(1)
        block = 0
    valid = counts > 0
    # Pooled sums of q·mask over pooled sums of the mask: the mean over the window's real tokens.
    landmark = sums / counts.clamp_min(1e-12)[:, None, :, None].to(q.dtype)
    return landmark, valid, block


def _landmarks_reference(
    q: Tensor, mask: Tensor | None, landmarks: int, causal: bool, grid: tuple[int, int] | None,
    extra_tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Explicit window-membership matrix [E, N] -> (L, valid [B, E], membership)."""
    batch, _, length, _ = q.shape
    weights = q.new_ones(batch, length) if mask is None else mask.to(q.dtype)
    if causal:
        block = -(-length // landmarks)
        position = torch.arange(length, device=q.device)
        member = (position[None, :] // block == torch.arange(-(-length // block), device=q.device)[:, None])
        member = member.to(q.dtype)
    else:
        pooled = length - extra_tokens
        if grid is None:
            body = _pool_windows(pooled, landmarks, q.device)
        else:
            rows, cols = grid_pool_shape(landmarks)
            row_windows = _pool_windows(grid[0], rows, q.device)  # [rows, h]
            col_windows = _pool_windows(grid[1], cols, q.device)  # [cols, w]
            body = torch.einsum("ah,bw->abhw", row_windows, col_windows).reshape(landmarks, pooled)
        member = F.pad(body, (extra_tokens, 0)).to(q.dtype)
    weighted = member[None] * weights[:, None, :]  # [B, E, N]
    counts = weighted.sum(-1)
    landmark = torch.einsum("ben,bhnd->bhed", weighted, q) / counts.clamp_min(1e-12)[:, None, :, None]
    return landmark, counts > 0, member


# -- partial attention with its log-sum-exp --------------------------------------------------------
def _attend(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, scale: float,
            causal: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of q over the `valid` keys (bool, broadcast to the scores); a row with no valid
    key gets an lse of about MASKED, i.e. no weight in `merge_partials`."""
    bias = None if valid is None else torch.where(valid, 0.0, MASKED).to(q.dtype)
    return attention_with_lse(q, k, v, bias=bias, causal=causal, scale=scale)


# -- routed experts, packed by expert -----------------------------------------------------------
def _take_rows(source: Tensor, index: Tensor) -> Tensor:
    """source[index] along the first axis, as an embedding lookup: its backward accumulates rows
    (measured 1.5-2x faster on CPU than index_select's scatter_add backward)."""
    return F.embedding(index, source.reshape(source.shape[0], -1)).view(-1, *source.shape[1:])


@dataclass
class _ExpertPacking:
    """(query, routed slot) items sorted by (group = b·H + h, expert), packed P to a block so that
    every block serves one expert of one group (the tail block of a bucket is padding)."""

    items: Tensor  # long [I]: flat index of each item in [B·H·N·R]
    slots: Tensor  # long [I]: its place in the packed [blocks·P] layout
    block_bucket: Tensor  # long [blocks]: group·E + expert of each block
    counts: Tensor  # long [B·H·E]: items per bucket
    blocks: int


def _pack_by_expert(assignment: Tensor, slot_valid: Tensor, experts: int, pack: int) -> _ExpertPacking:
    batch, heads = assignment.shape[:2]
    groups = batch * heads
    group_index = torch.arange(groups, device=assignment.device).view(batch, heads, 1, 1)
    bucket = (group_index * experts + assignment).reshape(-1)
    items = torch.nonzero(slot_valid.reshape(-1), as_tuple=True)[0]
    bucket = bucket[items]
    order = torch.argsort(bucket, stable=True)
    items, bucket = items[order], bucket[order]
    counts = torch.bincount(bucket, minlength=groups * experts)
    blocks_per_bucket = -(-counts // pack)
    bucket_start = torch.cumsum(counts, 0) - counts
    padded_start = (torch.cumsum(blocks_per_bucket, 0) - blocks_per_bucket) * pack
    rank = torch.arange(items.numel(), device=assignment.device) - bucket_start[bucket]
    block_bucket = torch.repeat_interleave(
        torch.arange(groups * experts, device=assignment.device), blocks_per_bucket)
    return _ExpertPacking(items, padded_start[bucket] + rank, block_bucket, counts, int(block_bucket.numel()))


def _packed_queries(q: Tensor, packing: _ExpertPacking, routes: int, pack: int) -> Tensor:
    """q [B, H, N, d] -> [blocks, P, d]: the queries of each packed block (zeros in padding)."""
    dim = q.shape[-1]
    rows = packing.items // routes  # row of q.reshape(B·H·N, d)
    rows_q = _take_rows(q.reshape(-1, dim), rows)
    packed = q.new_zeros(packing.blocks * pack, dim).index_copy(0, packing.slots, rows_q)
    return packed.view(packing.blocks, pack, dim)


def _unpack(packed: Tensor, packing: _ExpertPacking, total: int, fill: float = 0.0) -> Tensor:
    """[blocks, P, ...] -> [total, ...] in item order (`fill` where no item is)."""
    flat = _take_rows(packed.reshape(-1, *packed.shape[2:]), packing.slots)
    return flat.new_full((total, *packed.shape[2:]), fill).index_copy(0, packing.items, flat)


def _routed_parts(
    q: Tensor, expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor, assignment: Tensor,
    slot_valid: Tensor, scale: float, pack: int,
) -> tuple[Tensor, Tensor, int, Tensor]:
    """Partial softmax of every (query, routed slot) over its expert's K keys, computed expert-wise.

    q [B, H, N, d]; expert_keys / values [B, H, E, K, d|e]; expert_valid [B, H, E, K];
    assignment, slot_valid [B, H, N, R]. Returns (out [B, H, N, R, e], lse [B, H, N, R], executed
    FLOPs, per-bucket item counts [B·H·E]).
    """
    batch, heads, length, dim = q.shape
    experts, width, value_dim = expert_keys.shape[2], expert_keys.shape[3], expert_values.shape[-1]
    routes = assignment.shape[-1]
    packing = _pack_by_expert(assignment, slot_valid, experts, pack)
    buckets = batch * heads * experts
    keys = _take_rows(expert_keys.reshape(buckets, width, dim), packing.block_bucket)
    values = _take_rows(expert_values.reshape(buckets, width, value_dim), packing.block_bucket)
    key_valid = expert_valid.reshape(buckets, width).index_select(0, packing.block_bucket)
    packed_out, packed_lse = _attend(_packed_queries(q, packing, routes, pack)[:, None], keys[:, None],
                                     values[:, None], key_valid[:, None, None, :], scale)
    total = batch * heads * length * routes
    out = _unpack(packed_out[:, 0], packing, total).view(batch, heads, length, routes, value_dim)
    lse = _unpack(packed_lse[:, 0], packing, total, MASKED).view(batch, heads, length, routes)
    flops = dense_attention_flops(packing.blocks * pack * width, dim, value_dim)
    return out, lse, flops, packing.counts


def _fused_single_route(
    q: Tensor, landmark: Tensor, landmark_values: Tensor, landmark_ok: Tensor | None,
    expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor | None, assignment: Tensor,
    slot_valid: Tensor, shared: bool, scale: float, pack: int,
) -> tuple[Tensor, int, Tensor]:
    """R = 1, non-causal: each packed block of queries attends, in one fused SDPA call, to the
    concatenation [shared expert's E pairs; its expert's K pairs] — SDPA's online softmax is the
    log-sum-exp merge, done in-kernel. Returns (out [B, H, N, e], FLOPs, bucket counts)."""
    batch, heads, length, dim = q.shape
    experts, width, value_dim = expert_keys.shape[2], expert_keys.shape[3], expert_values.shape[-1]
    packing = _pack_by_expert(assignment, slot_valid, experts, pack)
    buckets = batch * heads * experts
    keys = expert_keys.reshape(buckets, width, dim)
    values = expert_values.reshape(buckets, width, value_dim)
    key_ok = None if expert_valid is None else expert_valid.reshape(buckets, width)
    if shared:
        # Every bucket's key set starts with its group's landmarks: built per bucket (B·H·E of them).
        group_landmarks = landmark.repeat_interleave(experts, dim=1).reshape(buckets, experts, dim)
        group_values = landmark_values.repeat_interleave(experts, dim=1).reshape(buckets, experts, value_dim)
        keys = torch.cat([group_landmarks, keys], dim=1)
        values = torch.cat([group_values, values], dim=1)
        if key_ok is not None or landmark_ok is not None:
            shared_ok = (torch.ones(batch, experts, dtype=torch.bool, device=q.device) if landmark_ok is None
                         else landmark_ok)
            shared_ok = shared_ok[:, None, None, :].expand(batch, heads, experts, experts)
            shared_ok = shared_ok.reshape(buckets, experts)
            routed_ok = (torch.ones(buckets, width, dtype=torch.bool, device=q.device) if key_ok is None
                         else key_ok)
            key_ok = torch.cat([shared_ok, routed_ok], dim=1)
    total = batch * heads * length
    if packing.items.numel() >= _LOOP_FACTOR * pack * buckets:
        # Long sequences: one SDPA call per (group, expert) over its queries, contiguous after the
        # sort; the bucket's key set is read in place (no per-block copies, no padding).
        sorted_q = _take_rows(q.reshape(-1, dim), packing.items)
        counts = packing.counts.tolist()
        # split/unbind (not slicing in a loop): their backward assembles the gradient in one pass.
        query_runs = torch.split(sorted_q, counts)
        bucket_keys, bucket_values = keys.unbind(0), values.unbind(0)
        bucket_ok = None if key_ok is None else key_ok.unbind(0)
        outs = []
        for bucket, count in enumerate(counts):
            if count == 0:
                continue
            bucket_q = query_runs[bucket][None, None]
            bucket_k, bucket_v = bucket_keys[bucket][None, None], bucket_values[bucket][None, None]
            if bucket_ok is None:
                outs.append(F.scaled_dot_product_attention(bucket_q, bucket_k, bucket_v, scale=scale)[0, 0])
            else:
                allowed = bucket_ok[bucket][None, None, None, :]
                outs.append(sdpa_allowed(bucket_q, bucket_k, bucket_v, allowed, scale)[0, 0])
        out = q.new_zeros(total, value_dim).index_copy(0, packing.items, torch.cat(outs))
        flops = dense_attention_flops(packing.items.numel() * keys.shape[1], dim, value_dim)
        return out.view(batch, heads, length, value_dim), flops, packing.counts
    # Short inputs: many small packs, where batched matmuls beat SDPA's per-batch-entry overhead
    # (the [blocks, P, S] scores are small: P is at most the mean bucket size).
    block_keys = _take_rows(keys, packing.block_bucket)  # [blocks, S, d]
    block_values = _take_rows(values, packing.block_bucket)
    scores = _packed_queries(q, packing, 1, pack) @ (block_keys * scale).transpose(1, 2)
    if key_ok is not None:  # every packed query has a valid key: its expert's landmark is real
        scores = scores.masked_fill(~key_ok.index_select(0, packing.block_bucket)[:, None], MASKED)
    packed_out = scores.softmax(dim=-1) @ block_values
    out = _unpack(packed_out, packing, total).view(batch, heads, length, value_dim)
    flops = dense_attention_flops(packing.blocks * pack * block_keys.shape[1], dim, value_dim)
    return out, flops, packing.counts


def _local_causal_part(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, block: int, scale: float):
    """Exact causal attention of each query over its own block -> (out, lse, FLOPs)."""
    batch, heads, length, dim = q.shape
    blocks = -(-length // block)
    pad = blocks * block - length

    def split(t: Tensor) -> Tensor:
        return F.pad(t, (0, 0, 0, pad)).view(batch, heads, blocks, block, t.shape[-1])

    valid = None  # the causal triangle is the kernel's; padding keys are masked on top of it
    if mask is not None:
        valid = F.pad(mask, (0, pad)).view(batch, 1, blocks, 1, block).expand(-1, heads, -1, block, -1)
        valid = valid.reshape(batch, heads * blocks, block, block)
    # Blocks folded into the head axis: one causal kernel call over [B, H·blocks, b, d].
    out, lse = _attend(*(split(t).flatten(1, 2) for t in (q, k, v)), valid, scale, causal=True)
    out = out.reshape(batch, heads, blocks * block, -1)[:, :, :length]
    lse = lse.reshape(batch, heads, blocks * block)[:, :, :length]
    return out, lse, batch * heads * dense_attention_flops(blocks * block * block, dim, v.shape[-1])


def _gather_experts(k: Tensor, v: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """index [B, H, E, K] into k, v [B, H, N, d|e] -> [B, H, E, K, d|e], gathered once per expert.

    Flat row lookups, so the backward pass accumulates into [B·H·N, d], not into an
    E-fold expanded copy of the keys."""
    rows = _flat_rows(index, k.shape[2])
    shape = (*index.shape, -1)
    return (_take_rows(k.reshape(-1, k.shape[-1]), rows).view(shape),
            _take_rows(v.reshape(-1, v.shape[-1]), rows).view(shape))


# -- the op -------------------------------------------------------------------------------------
def _landmark_key_allowed(length: int, block: int, experts: int, causal: bool, mask: Tensor | None,
                          device: torch.device) -> Tensor | None:
    """Bool [B|1, 1, E, N]: the keys landmark j may score (causal: blocks ≤ j)."""
    allowed = None
    if causal:
        key_block = torch.arange(length, device=device) // block
        allowed = (key_block[None, :] <= torch.arange(experts, device=device)[:, None])[None, None]
    if mask is not None:
        real = mask[:, None, None, :]
        allowed = real if allowed is None else allowed & real
    return allowed


def _expert_eligible(length: int, block: int, valid: Tensor, causal: bool) -> Tensor:
    """Bool [B, 1, N, E]: the landmarks/experts a query may use (causal: blocks before its own)."""
    eligible = valid[:, None, None, :]
    if causal:
        query_block = torch.arange(length, device=valid.device) // block
        earlier = torch.arange(valid.shape[1], device=valid.device)[None, :] < query_block[:, None]
        eligible = eligible & earlier[None, None]
    return eligible


def mita_attention(
    q: Tensor, k: Tensor, v: Tensor, *, landmarks: int = 25, topk: int = 25, route: int = 1,
    shared: bool = True, causal: bool = False, grid: tuple[int, int] | None = None,
    extra_tokens: int = 0, mask: Tensor | None = None, scale: float | None = None,
    pack: int = DEFAULT_PACK,
) -> MitaResult:
    """MiTA attention over q, k, v [B, H, N, d] (see the module docstring for the algorithm).

    landmarks: E, the landmark queries (= experts); topk: K keys per expert (0 = Agent attention,
    compression only); route: R experts per query; shared: keep the shared compressed expert
    (False = route-only); grid: (h, w) of an image token grid for 2-D pooling; extra_tokens:
    leading tokens (CLS) left out of the pooling; mask: bool key padding [B, N].
    """
    check_qkv(q, k, v, mask, causal=True)  # MiTA is self-attention: as many queries as keys
    batch, heads, length, dim = q.shape
    check_mita_args(length, landmarks=landmarks, topk=topk, route=route, causal=causal, grid=grid,
                    extra_tokens=extra_tokens)
    check_positive("pack", pack)
    if not shared and topk == 0 and not causal:
        raise ValueError("shared=False with topk=0 leaves a query no key to attend to")
    scale = dim ** -0.5 if scale is None else scale
    landmark, landmark_valid, block = _landmarks(q, mask, landmarks, causal, grid, extra_tokens)
    experts = landmark.shape[2]
    # Short inputs route a few queries to each expert: packs no larger than that average keep the
    # padding (which is executed work) below about half of the packed slots.
    per_expert = max(1.0, length * min(route, experts) / experts)
    pack = min(pack, 1 << int(math.log2(per_expert)))

    # Landmark scores: the keys of each expert and the landmark values share them (Eqs. 6-8).
    landmark_scores = (landmark * scale) @ k.transpose(-1, -2)  # [B, H, E, N]
    allowed = _landmark_key_allowed(length, block, experts, causal, mask, q.device)
    if allowed is not None:
        landmark_scores = landmark_scores.masked_fill(~allowed, MASKED)
    flops = batch * heads * dense_attention_flops(experts * length, dim, v.shape[-1])
    landmark_values = landmark_scores.softmax(dim=-1) @ v  # [B, H, E, e]

    eligible = _expert_eligible(length, block, landmark_valid, causal)  # broadcasts to [B, H, N, E]
    if bool(eligible.all()):
        eligible = None  # every query may use every landmark: no masking anywhere below
    width = min(topk, length)
    routes = min(route, experts)
    fused = width > 0 and routes == 1 and not causal
    parts = []
    if shared and not fused:
        # The kernel recomputes q·Lᵀ next to the routing logits: cheaper on CPU than a
        # materialised softmax over the routing logits (Eq. 9's reuse), and counted as executed.
        parts.append(_attend(q, landmark, landmark_values, eligible, scale))
        flops += batch * heads * dense_attention_flops(length * experts, dim, v.shape[-1])

    counts = torch.zeros(batch * heads * experts, dtype=torch.long, device=q.device)
    if width > 0:
        top = landmark_scores.topk(width, dim=-1)
        expert_valid = None
        if allowed is not None:
            expert_valid = (top.values > MASKED / 2) & landmark_valid[:, None, :, None]
        expert_keys, expert_values = _gather_experts(k, v, top.indices)
        query_logits = q @ (landmark * scale).transpose(-1, -2)  # routing logits [B, H, N, E]
        flops += batch * heads * 2 * length * experts * dim
        if eligible is not None:
            query_logits = query_logits.masked_fill(~eligible, MASKED)
        routed = query_logits.topk(routes, dim=-1)
        slot_valid = routed.values > MASKED / 2
        if fused:
            landmark_ok = None if bool(landmark_valid.all()) else landmark_valid
            out, fused_flops, counts = _fused_single_route(
                q, landmark, landmark_values, landmark_ok, expert_keys, expert_values, expert_valid,
                routed.indices, slot_valid, shared, scale, pack)
            load = counts.view(-1, experts).sum(0).to(q.dtype)
            return MitaResult(out, int(flops + fused_flops), load / load.sum().clamp_min(1))
        if expert_valid is None:
            expert_valid = torch.ones_like(top.values, dtype=torch.bool)
        routed_out, routed_lse, routed_flops, counts = _routed_parts(
            q, expert_keys, expert_values, expert_valid, routed.indices, slot_valid, scale, pack)
        parts.extend((routed_out[:, :, :, slot], routed_lse[:, :, :, slot]) for slot in range(routes))
        flops += routed_flops
    if causal:
        out, lse, local_flops = _local_causal_part(q, k, v, mask, block, scale)
        parts.append((out, lse))
        flops += local_flops
    load = counts.view(-1, experts).sum(0).to(q.dtype)
    return MitaResult(merge_partials(parts), int(flops), load / load.sum().clamp_min(1))


def mita_reference(
    q: Tensor, k: Tensor, v: Tensor, *, landmarks: int = 25, topk: int = 25, route: int = 1,
    shared: bool = True, causal: bool = False, grid: tuple[int, int] | None = None,
    extra_tokens: int = 0, mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """The specification of `mita_attention`: each query's key set as a dense [N, E + N] logit
    matrix (shared pairs, then every key with log(how many of its routed experts hold it), then,
    causal, its own block's earlier keys), and one plain softmax."""
    check_qkv(q, k, v, mask, causal=True)
    batch, heads, length, dim = q.shape
    check_mita_args(length, landmarks=landmarks, topk=topk, route=route, causal=causal, grid=grid,
                    extra_tokens=extra_tokens)
    scale = dim ** -0.5 if scale is None else scale
    landmark, landmark_valid, member = _landmarks_reference(q, mask, landmarks, causal, grid, extra_tokens)
    experts = landmark.shape[2]
    position = torch.arange(length, device=q.device)
    block = -(-length // landmarks)
    key_real = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask

    landmark_allowed = key_real[:, None, None, :].expand(batch, 1, experts, length)
    query_may_use = landmark_valid[:, None, None, :].expand(batch, 1, length, experts)
    if causal:
        expert_index = torch.arange(experts, device=q.device)
        landmark_allowed = landmark_allowed & (position[None, :] // block <= expert_index[:, None])
        query_may_use = query_may_use & (expert_index[None, :] < position[:, None] // block)
    scores = (landmark @ k.transpose(-1, -2)) * scale
    masked_scores = scores.masked_fill(~landmark_allowed, float("-inf"))
    landmark_values = torch.nan_to_num(masked_scores.softmax(-1)) @ v

    # Membership of every key in every expert [B, H, E, N], then per query over its routed experts.
    holds = torch.zeros_like(scores)
    width = min(topk, length)
    if width:
        top = masked_scores.topk(width, dim=-1)
        holds.scatter_(-1, top.indices, torch.isfinite(top.values).to(scores.dtype))
    query_logits = (q @ landmark.transpose(-1, -2)) * scale  # [B, H, N, E]
    routed = query_logits.masked_fill(~query_may_use, float("-inf")).topk(min(route, experts), dim=-1)
    chosen = torch.isfinite(routed.values).to(q.dtype)
    copies = torch.zeros_like(query_logits).scatter_(-1, routed.indices, chosen)
    if width == 0:
        copies = torch.zeros_like(copies)
    multiplicity = copies @ holds  # [B, H, N, N]: how many routed experts of query i hold key n
    if causal:
        same_block = position[:, None] // block == position[None, :] // block
        own_block = same_block & (position[None, :] <= position[:, None])
        multiplicity = multiplicity + (own_block & key_real[:, None, None, :]).to(q.dtype)

    key_logits = (q @ k.transpose(-1, -2)) * scale + torch.log(multiplicity)
    shared_logits = query_logits.masked_fill(~query_may_use, float("-inf"))
    if not shared:
        shared_logits = torch.full_like(shared_logits, float("-inf"))
    logits = torch.cat([shared_logits, key_logits], dim=-1)
    weights = torch.nan_to_num(logits.softmax(-1))
    return weights @ torch.cat([landmark_values, v.expand(batch, heads, length, -1)], dim=2)
