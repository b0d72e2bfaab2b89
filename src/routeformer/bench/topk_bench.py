"""`routeformer bench topk`: the topk (ADSR) op — routing + gathered attention — against SDPA.

The op under test is what the layer runs after its projections: `route_topk` on r-dim routing
vectors, then `routed_attention` over the K selected keys (plain logits, as with
routing_learning="distill"/"none"; "score_bias" adds r dims to each gathered key). Routing
vectors are fixed inputs drawn once per length, like q, k, v. Causal, B = 1.
Two implementations of the op: the default (the fused C kernels of ops/native for routing and the
attention forward and backward, when a C compiler is present) and, up to `pytorch_up_to`, the
PyTorch ops alone ("torch ops").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from routeformer.ops import route_topk, routed_attention
from routeformer.ops.native import native_enabled


def topk_op_table(
    batch: int, heads: int, routing_dim: int, topk: int, pytorch_up_to: int = 16384
) -> Callable[[int], dict[str, Callable]]:
    def table(length: int) -> dict[str, Callable]:
        gen = torch.Generator().manual_seed(length + 1)
        route_q, route_k = (torch.randn(batch, heads, length, routing_dim, generator=gen) for _ in range(2))

        def topk_attention(q, k, v):
            index, valid, _ = route_topk(route_q, route_k, topk, causal=True)
            return routed_attention(q, k, v, index, valid)[0]

        def topk_attention_torch_ops(q, k, v):
            with native_enabled(False):
                return topk_attention(q, k, v)

        implementations = {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            f"topk(K={topk},r={routing_dim})": topk_attention,
        }
        if length <= pytorch_up_to:
            implementations[f"topk(K={topk},r={routing_dim}, torch ops)"] = topk_attention_torch_ops
        return implementations
    return table
