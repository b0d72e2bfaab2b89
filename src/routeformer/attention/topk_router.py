"""The `topk` layer's router (attention/topk.py): the routing vectors route_q, route_k of every
token, computed in fp32, with the position term the layer's `routing_positions` asks for."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention.base import split_qkv
from routeformer.ops.rotary import apply_rotary, rotary_angles


class Router(nn.Module):
    """x [B, T, D], positions [B, T] -> (route_q, route_k) [B, R, T, r]: linear, a GELU MLP, or
    frozen random, then the position term of `routing_positions` (see the module docstring).

    "rotary": route_q(i) and route_k(j) are rotated by the angles of positions i and j (RoPE with
    `rotary_base`), so s_ij = rq_i · R(j - i) rk_j depends on the offset as attention's rotated
    q·k does. "recency": one extra routing dim holds a learned per-routing-head slope
    β = softplus(a) on the query side and the key's position on the key side, so
    s_ij = rq_i · rk_j + β·j, which ranks keys as rq_i · rk_j − β·(i − j) does (β·i is constant
    in a row): an ALiBi-style preference for nearby keys, one scalar per routing head.
    "rotary+recency": both (rotation first, then the recency dim).
    """

    def __init__(self, dim: int, routing_heads: int, routing_dim: int, hidden: int, frozen: bool,
                 positions: str = "none", rotary_base: float = 10000.0,
                 recency_init: float | None = None) -> None:
        super().__init__()
        self.routing_heads, self.routing_dim = routing_heads, routing_dim
        self.positions, self.rotary_base = positions, rotary_base
        out_features = 2 * routing_heads * routing_dim
        if frozen:
            # Fixed random projections: a buffer, so optimisers and gradient checks never see it.
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(out_features, dim, generator=generator) / math.sqrt(dim)
            self.register_buffer("random_weight", weight)
            self.net = None
        elif hidden:
            self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, out_features))
        else:
            self.net = nn.Linear(dim, out_features, bias=False)
        if "recency" in positions:
            # β starts at softplus(-3) ≈ 0.05 per position: a mild preference the router can grow.
            # Starting at softplus(0) ≈ 0.69 (16 keys back cost 11: a near-local window from
            # step 0) solved previous-token as well but lost on the char LM (topk-position-lm,
            # 3 seeds): recency 2.84 ± 0.43 bits/char against 2.40 ± 0.04, rotary+recency
            # 2.90 ± 0.06 against 2.63 ± 0.04.
            # recency_init (> 0) starts β elsewhere, e.g. near 0 when a dense model's attention is
            # the target (train/sparsify.py).
            logit = -3.0 if recency_init is None else math.log(math.expm1(recency_init))
            slope = torch.full((routing_heads,), logit)
            if frozen:
                self.register_buffer("recency_logit", slope)
            else:
                self.recency_logit = nn.Parameter(slope)

    @property
    def space_dim(self) -> int:
        """Width of the routing vectors route_topk sees: r, plus one for the recency term."""
        return self.routing_dim + ("recency" in self.positions)

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        batch, length, _ = x.shape
        # Routing runs in fp32 whatever the model's dtype: a bf16/fp16 rounding of the scores
        # flips near-tied selections (measured 5-11% output error in bf16 before).
        x32 = x.float()
        if self.net is None:
            projected = F.linear(x32, self.random_weight.float())
        else:
            with torch.autocast(x.device.type, enabled=False):
                projected = fp32_forward(self.net, x32)
        projected = projected.view(batch, length, 2, self.routing_heads, self.routing_dim)
        route_q, route_k = split_qkv(projected)
        if "rotary" in self.positions:
            cos, sin = rotary_angles(positions, self.routing_dim, self.rotary_base)
            route_q, route_k = apply_rotary(route_q, cos, sin), apply_rotary(route_k, cos, sin)
        if "recency" in self.positions:
            slope = F.softplus(self.recency_logit.float()).view(1, -1, 1, 1)
            route_q = torch.cat([route_q, slope.expand(batch, -1, length, 1)], dim=-1)
            where = positions.to(torch.float32)[:, None, :, None].expand(batch, self.routing_heads, length, 1)
            route_k = torch.cat([route_k, where], dim=-1)
        return route_q, route_k


def fp32_forward(net: nn.Module, x32: Tensor) -> Tensor:
    """net(x32) with every Linear computed in fp32 from (possibly low-precision) weights; the
    weights stay as they are, gradients reach them through the casts."""
    if isinstance(net, nn.Linear):
        bias = None if net.bias is None else net.bias.float()
        return F.linear(x32, net.weight.float(), bias)
    out = x32
    for layer in net:
        out = fp32_forward(layer, out) if isinstance(layer, nn.Linear) else layer(out)
    return out
