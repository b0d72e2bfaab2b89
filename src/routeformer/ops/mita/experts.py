"""MiTA's expert machinery: partial attention with its log-sum-exp, routed experts packed by expert,
the fused single-route pass (bidirectional, R = 1) and the causal own-block pass.

Axes: B batch, H heads, N length, d head dim (e value dim), E experts, K keys per expert, R routed
experts per query, P packed query slots per block. Wen et al. (arXiv 2602.01219), Eqs. 9-10: each
query reads the shared expert's E pairs and its R routed experts' K pairs, under one softmax —
computed here part by part, each part returning its log-sum-exp for `merge_partials`, or (R = 1,
bidirectional) in one fused SDPA call per packed block. See ops/mita/op.py for the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops.attention_lse import MASKED, attention_with_lse
from routeformer.ops.backends import TRITON, mita_parts_backend
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.full.op import sdpa_allowed
from routeformer.ops.topk.gathered import flat_rows

# Buckets averaging at least this many packs of queries run one SDPA call each instead of packing.
_LOOP_FACTOR = 4


# -- partial attention with its log-sum-exp --------------------------------------------------------
def attend_part(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, scale: float,
            causal: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of q over the `valid` keys (bool, broadcast to the scores); a row with no valid
    key gets an lse of about MASKED, i.e. no weight in `merge_partials`."""
    bias = None if valid is None else torch.where(valid, 0.0, MASKED).to(q.dtype)
    return attention_with_lse(q, k, v, bias=bias, causal=causal, scale=scale)


# -- routed experts, packed by expert -----------------------------------------------------------
def take_rows(source: Tensor, index: Tensor) -> Tensor:
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
    rows_q = take_rows(q.reshape(-1, dim), rows)
    packed = q.new_zeros(packing.blocks * pack, dim).index_copy(0, packing.slots, rows_q)
    return packed.view(packing.blocks, pack, dim)


def _unpack(packed: Tensor, packing: _ExpertPacking, total: int, fill: float = 0.0) -> Tensor:
    """[blocks, P, ...] -> [total, ...] in item order (`fill` where no item is)."""
    flat = take_rows(packed.reshape(-1, *packed.shape[2:]), packing.slots)
    return flat.new_full((total, *packed.shape[2:]), fill).index_copy(0, packing.items, flat)


def routed_parts(
    q: Tensor, expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor, assignment: Tensor,
    slot_valid: Tensor, scale: float, pack: int,
) -> tuple[Tensor, Tensor, int, Tensor]:
    """Partial softmax of every (query, routed slot) over its expert's K keys, computed expert-wise.

    q [B, H, N, d]; expert_keys / values [B, H, E, K, d|e]; expert_valid [B, H, E, K];
    assignment, slot_valid [B, H, N, R]. Returns (out [B, H, N, R, e], lse [B, H, N, R], executed
    FLOPs, per-bucket item counts [B·H·E]).
    """
    if mita_parts_backend("mita_routed_parts", q)[0] == TRITON:  # no packing needed
        from routeformer.ops.triton.mita import triton_routed_parts  # triton is optional

        return triton_routed_parts(q, expert_keys, expert_values, expert_valid, assignment, slot_valid, scale)
    batch, heads, length, dim = q.shape
    experts, width, value_dim = expert_keys.shape[2], expert_keys.shape[3], expert_values.shape[-1]
    routes = assignment.shape[-1]
    packing = _pack_by_expert(assignment, slot_valid, experts, pack)
    buckets = batch * heads * experts
    keys = take_rows(expert_keys.reshape(buckets, width, dim), packing.block_bucket)
    values = take_rows(expert_values.reshape(buckets, width, value_dim), packing.block_bucket)
    key_valid = expert_valid.reshape(buckets, width).index_select(0, packing.block_bucket)
    packed_out, packed_lse = attend_part(_packed_queries(q, packing, routes, pack)[:, None], keys[:, None],
                                     values[:, None], key_valid[:, None, None, :], scale)
    total = batch * heads * length * routes
    out = _unpack(packed_out[:, 0], packing, total).view(batch, heads, length, routes, value_dim)
    lse = _unpack(packed_lse[:, 0], packing, total, MASKED).view(batch, heads, length, routes)
    flops = dense_attention_flops(packing.blocks * pack * width, dim, value_dim)
    return out, lse, flops, packing.counts


def fused_single_route(
    q: Tensor, landmark: Tensor, landmark_values: Tensor, landmark_ok: Tensor | None,
    expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor | None, assignment: Tensor,
    slot_valid: Tensor, shared: bool, scale: float, pack: int,
) -> tuple[Tensor, int, Tensor]:
    """R = 1, non-causal: each packed block of queries attends, in one fused SDPA call, to the
    concatenation [shared expert's E pairs; its expert's K pairs] — SDPA's online softmax is the
    log-sum-exp merge, done in-kernel. Returns (out [B, H, N, e], FLOPs, bucket counts)."""
    if mita_parts_backend("mita_fused_single_route", q)[0] == TRITON:  # no per-expert loop
        return _fused_single_route_triton(q, landmark, landmark_values, landmark_ok, expert_keys,
                                          expert_values, expert_valid, assignment, slot_valid, shared, scale)
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
        sorted_q = take_rows(q.reshape(-1, dim), packing.items)
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
    block_keys = take_rows(keys, packing.block_bucket)  # [blocks, S, d]
    block_values = take_rows(values, packing.block_bucket)
    scores = _packed_queries(q, packing, 1, pack) @ (block_keys * scale).transpose(1, 2)
    if key_ok is not None:  # every packed query has a valid key: its expert's landmark is real
        scores = scores.masked_fill(~key_ok.index_select(0, packing.block_bucket)[:, None], MASKED)
    packed_out = scores.softmax(dim=-1) @ block_values
    out = _unpack(packed_out, packing, total).view(batch, heads, length, value_dim)
    flops = dense_attention_flops(packing.blocks * pack * block_keys.shape[1], dim, value_dim)
    return out, flops, packing.counts


def _fused_single_route_triton(
    q: Tensor, landmark: Tensor, landmark_values: Tensor, landmark_ok: Tensor | None, expert_keys: Tensor,
    expert_values: Tensor, expert_valid: Tensor | None, assignment: Tensor, slot_valid: Tensor, shared: bool,
    scale: float,
) -> tuple[Tensor, int, Tensor]:
    """`fused_single_route` on the Triton kernels (R = 1, bidirectional): the routed expert on the
    gathered kernel, the shared expert's E pairs as one dense [N, E] part, the two merged by the
    lse-merge kernel — the same softmax over [shared pairs; routed pairs]."""
    from routeformer.ops.triton.lse_merge import triton_merge_partials  # triton is optional
    from routeformer.ops.triton.mita import triton_routed_parts

    if expert_valid is None:
        expert_valid = torch.ones(expert_keys.shape[:4], dtype=torch.bool, device=q.device)
    out, lse, flops, counts = triton_routed_parts(q, expert_keys, expert_values, expert_valid, assignment,
                                                  slot_valid, scale)
    out, lse = out[:, :, :, 0], lse[:, :, :, 0]
    routed = slot_valid[..., :1].to(out.dtype)  # a query routed nowhere returns zeros, as on CPU
    if not shared:
        return out * routed, flops, counts
    allowed = None if landmark_ok is None else landmark_ok[:, None, None, :]
    shared_part = attend_part(q, landmark, landmark_values, allowed, scale)
    batch, heads, length, dim = q.shape
    flops += batch * heads * dense_attention_flops(length * landmark.shape[2], dim, landmark_values.shape[-1])
    return triton_merge_partials([shared_part, (out, lse)]) * routed, flops, counts


def local_causal_part(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, block: int, scale: float):
    """Exact causal attention of each query over its own block -> (out, lse, FLOPs)."""
    batch, heads, length, dim = q.shape
    block = min(block, length)  # one short block: no padding to the full block size
    blocks = -(-length // block)
    pad = blocks * block - length

    def split(t: Tensor) -> Tensor:
        return F.pad(t, (0, 0, 0, pad)).view(batch, heads, blocks, block, t.shape[-1])

    valid = None  # the causal triangle is the kernel's; padding keys are masked on top of it
    if mask is not None:
        valid = F.pad(mask, (0, pad)).view(batch, 1, blocks, 1, block).expand(-1, heads, -1, block, -1)
        valid = valid.reshape(batch, heads * blocks, block, block)
    # Blocks folded into the head axis: one causal kernel call over [B, H·blocks, b, d].
    out, lse = attend_part(*(split(t).flatten(1, 2) for t in (q, k, v)), valid, scale, causal=True)
    out = out.reshape(batch, heads, blocks * block, -1)[:, :, :length]
    lse = lse.reshape(batch, heads, blocks * block)[:, :, :length]
    return out, lse, batch * heads * dense_attention_flops(blocks * block * block, dim, v.shape[-1])


def gather_experts(k: Tensor, v: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """index [B, H, E, K] into k, v [B, H, N, d|e] -> [B, H, E, K, d|e], gathered once per expert.

    Flat row lookups, so the backward pass accumulates into [B·H·N, d], not into an
    E-fold expanded copy of the keys."""
    rows = flat_rows(index, k.shape[2])
    shape = (*index.shape, -1)
    return (take_rows(k.reshape(-1, k.shape[-1]), rows).view(shape),
            take_rows(v.reshape(-1, v.shape[-1]), rows).view(shape))
