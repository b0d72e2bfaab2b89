"""MiTA's routed experts on the Triton gathered-attention kernel (`routed_parts` on a GPU).

Axes: B batch, H heads, N length, d / e dims, E experts, K keys per expert, R routed experts per
query. Wen et al. (arXiv 2602.01219), Eqs. 9-10: each query reads, per routed slot r, the K keys of
expert assignment[r] under its own softmax; the parts are then merged with the shared expert (and,
causal, the own block) by their log-sum-exp (`merge_partials`, on CUDA the `lse_merge` kernel).

The CPU path (`ops.mita.experts.routed_parts`, the reference here) sorts the (query, slot) items by
expert and packs them into dense blocks for batched SDPA. On a GPU no packing is needed: the
experts' keys [B, H, E, K, d] are a key table of E·K rows, and slot r of query n reads rows
assignment·K .. assignment·K + K − 1 — gathered attention, whose kernel returns the lse with its
gradient. The R slots ride on the query axis (N·R query rows, each q repeated R times: O(N·R·d)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.attention_lse import MASKED
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.triton.gathered import triton_routed_attention


def triton_routed_parts(
    q: Tensor, expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor, assignment: Tensor,
    slot_valid: Tensor, scale: float,
) -> tuple[Tensor, Tensor, int, Tensor]:
    """`routed_parts` by the Triton kernel: (out [B, H, N, R, e], lse [B, H, N, R] (MASKED for a slot
    with no valid key, as the CPU path), executed FLOPs, per-bucket item counts [B·H·E]).

    q [B, H, N, d]; expert_keys / values [B, H, E, K, d|e]; expert_valid [B, H, E, K];
    assignment (long), slot_valid (bool) [B, H, N, R]."""
    batch, heads, length, dim = q.shape
    experts, width = expert_keys.shape[2], expert_keys.shape[3]
    value_dim, routes = expert_values.shape[-1], assignment.shape[-1]
    if expert_keys.shape[:2] != q.shape[:2] or expert_values.shape[:4] != expert_keys.shape[:4] \
            or expert_valid.shape != expert_keys.shape[:4]:
        raise ValueError("expert_keys, expert_values, expert_valid must be [B, H, E, K, d], [B, H, E, K, e], "
                         f"[B, H, E, K]; got {tuple(expert_keys.shape)}, {tuple(expert_values.shape)}, "
                         f"{tuple(expert_valid.shape)}")
    if assignment.shape != slot_valid.shape or assignment.shape[:3] != q.shape[:3]:
        raise ValueError("assignment and slot_valid must be [B, H, N, R] with [B, H, N] = "
                         f"{tuple(q.shape[:3])}; got {tuple(assignment.shape)} and {tuple(slot_valid.shape)}")
    slots = torch.arange(width, device=q.device)
    index = assignment[..., None] * width + slots  # [B, H, N, R, K] rows of the E·K key table
    valid = expert_valid.reshape(batch, heads, experts * width).gather(
        2, index.reshape(batch, heads, -1)).view(index.shape) & slot_valid[..., None]
    queries = q[:, :, :, None, :].expand(-1, -1, -1, routes, -1).reshape(batch, heads, length * routes, dim)
    out, lse = triton_routed_attention(
        queries, expert_keys.reshape(batch, heads, experts * width, dim),
        expert_values.reshape(batch, heads, experts * width, value_dim),
        index.reshape(batch, heads, length * routes, width),
        valid.reshape(batch, heads, length * routes, width), scale=scale)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, MASKED), lse)
    group = torch.arange(batch * heads, device=q.device).view(batch, heads, 1, 1) * experts
    counts = torch.bincount((group + assignment)[slot_valid], minlength=batch * heads * experts)
    flops = dense_attention_flops(batch * heads * length * routes * width, dim, value_dim)
    return (out.view(batch, heads, length, routes, value_dim), lse.view(batch, heads, length, routes),
            flops, counts)
