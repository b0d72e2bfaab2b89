"""The routing selection's argument check and slot count, shared by the PyTorch op
(ops/topk/routing.py) and its Triton kernel (ops/triton/topk_routing.py), which both import it
from here so that neither imports the other."""

from __future__ import annotations

import torch
from torch import Tensor


def check_routing(route_q: Tensor, route_k: Tensor, key_mask: Tensor | None, causal: bool) -> None:
    """ValueError naming route_q / route_k / key_mask when their shapes or dtype do not fit."""
    if route_q.dim() != 4 or route_k.dim() != 4 or route_q.shape[:2] != route_k.shape[:2] \
            or route_q.shape[-1] != route_k.shape[-1]:
        raise ValueError(
            "route_q and route_k must be [B, R, T, r] and [B, R, S, r] with matching B, R, r; "
            f"got {tuple(route_q.shape)} and {tuple(route_k.shape)}"
        )
    if causal and route_q.shape[2] != route_k.shape[2]:
        raise ValueError(f"causal routing needs as many queries as keys; got {route_q.shape[2]} "
                         f"and {route_k.shape[2]}")
    if key_mask is not None and (key_mask.dtype != torch.bool
                                 or key_mask.shape != (route_k.shape[0], route_k.shape[2])):
        raise ValueError(f"key_mask must be bool [B, S] = {(route_k.shape[0], route_k.shape[2])}; "
                         f"got {key_mask.dtype} {tuple(key_mask.shape)}")


def routing_slots(topk: int, local_window: int, global_tokens: int, num_keys: int) -> int:
    """Slots per query: routed + forced, capped by the number of keys."""
    return min(num_keys, topk + local_window + global_tokens)
