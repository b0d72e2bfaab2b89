"""`gated`: full attention with an elementwise sigmoid output gate (Qiu et al. 2025).

    Y = SDPA(Q, K, V) ⊙ sigmoid(x W_g),  out = Y W_o
The gate is per head and per channel (H·d gates per token), applied after the attention and
before the output projection — the position the paper found best ("G1"). It adds
non-linearity between W_v and W_o and lets a head output nothing (no attention sink needed).
"""

from __future__ import annotations

from torch import Tensor, nn

from routeformer.attention.full import FullAttention
from routeformer.attention.registry import register_attention


@register_attention("gated", every_parameter_used=True)
class GatedAttention(FullAttention):
    """`full` with the output gate sigmoid(x W_g) (H·d gates per token).

    Args (beyond dim, heads, causal): the common options of `AttentionLayer` (head_dim, bias,
    rotary, rotary_base, kv_heads); kv_heads < heads as in `full` (no K/V copy per query head).
    """

    def __init__(self, dim: int, heads: int, causal: bool = True, **common) -> None:
        super().__init__(dim, heads, causal, **common)
        self.gate_proj = nn.Linear(dim, self.heads * self.head_dim, bias=True)

    def merge_heads(self, heads_out: Tensor, x: Tensor) -> Tensor:
        return super().merge_heads(heads_out, x) * self.gate_proj(x).sigmoid()
