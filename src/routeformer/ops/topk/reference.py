"""Top-k routing, the specifications: `route_topk_reference` (the routing selection),
`routed_attention_reference` (attention over the gathered keys) and `gathered_dot_reference`.

Axes: B batch, R routing heads, H heads, T queries, S keys, r routing dim, d key dim, K slots.
Written the obvious way: all T×S scores, dense masks, one `topk` (a stable sort) or one masked
softmax. `block_masks` (the eligibility rule, which ops/topk/routing.py imports from here) and
`slot_membership` (the routed keys as a mask, which the layer and its loss import from here too) keep
this twin free of fast-path imports
(tests/ops/test_references_independent.py); the argument check and slot count come from
ops/topk/slots.py, which imports nothing but torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.full.reference import masked_attention_reference
from routeformer.ops.topk.slots import check_routing, routing_slots


def block_masks(
    start: int, stop: int, first_col: int, end_col: int, num_keys: int, causal: bool,
    local_window: int, global_tokens: int, device: torch.device,
) -> tuple[Tensor, Tensor | None]:
    """(ineligible, forced or None), bool [stop - start, end_col - first_col], for query rows
    start..stop and key columns first_col..end_col."""
    rows = torch.arange(start, stop, device=device)[:, None]
    cols = torch.arange(first_col, end_col, device=device)[None, :]
    ineligible = cols >= num_keys
    if causal:
        ineligible = ineligible | (cols > rows)
    forced = None
    if local_window or global_tokens:
        forced = ((cols <= rows) & (cols > rows - local_window)) | (cols < global_tokens)
    return ineligible, forced


def route_topk_reference(
    route_q: Tensor, route_k: Tensor, topk: int, *, causal: bool = True, key_mask: Tensor | None = None,
    local_window: int = 0, global_tokens: int = 0,
) -> Tensor:
    """The specification of `route_topk`: all scores, masks, one `topk`. Returns the selected set
    as a bool [B, R, T, S] membership mask (slot order is not part of the contract)."""
    check_routing(route_q, route_k, key_mask, causal)
    length, num_keys = route_q.shape[2], route_k.shape[2]
    scores = route_q @ route_k.transpose(-1, -2)
    ineligible, forced = block_masks(0, length, 0, num_keys, num_keys, causal, local_window,
                                      global_tokens, route_q.device)
    if forced is not None:
        scores = scores.masked_fill(forced, float("inf"))
    scores = scores.masked_fill(ineligible, float("-inf"))
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    slots = routing_slots(topk, local_window, global_tokens, num_keys)
    # Among equal scores the lower key index wins: a stable sort keeps them in index order.
    values, chosen = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, chosen = values[..., :slots], chosen[..., :slots]
    member = torch.zeros_like(scores, dtype=torch.bool)
    return member.scatter_(-1, chosen, values > float("-inf"))


def routed_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor, *, scale: float | None = None
) -> Tensor:
    """The specification of `routed_attention`: a dense [B, H, T, S] mask of the routed keys."""
    return masked_attention_reference(q, k, v, slot_membership(index, valid, k.shape[2]), scale)


def slot_membership(index: Tensor, valid: Tensor, num_keys: int) -> Tensor:
    """Bool [..., T, S]: which keys the valid slots of each row name."""
    counts = torch.zeros(*index.shape[:-1], num_keys, dtype=torch.int32, device=index.device)
    return counts.scatter_add_(-1, index, valid.to(torch.int32)) > 0


def gathered_dot_reference(a: Tensor, b: Tensor, index: Tensor) -> Tensor:
    """The specification of `gathered_dot`: all scores, then `gather`."""
    return (a @ b.transpose(-1, -2)).gather(-1, index)
