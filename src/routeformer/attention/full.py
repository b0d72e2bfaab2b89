"""`full`: multi-head softmax attention through scaled_dot_product_attention."""

from __future__ import annotations

from torch import Tensor

from routeformer.attention.base import AttentionLayer, key_value_bytes
from routeformer.attention.registry import register_attention
from routeformer.ops.decode import append_keys_values, cached_softmax_attention
from routeformer.ops.full import full_attention, full_attention_flops


@register_attention("full", baseline=True, every_parameter_used=True)
class FullAttention(AttentionLayer):
    """Standard multi-head attention: softmax(q kᵀ / sqrt(d)) v, O(T²) time.

    Args (beyond dim, heads, causal): the common options of `AttentionLayer` (head_dim, bias,
    rotary, rotary_base, kv_heads). With kv_heads < heads, SDPA reads each K/V head for its group
    of query heads (`enable_gqa`, no copy per query head) and the decode cache holds kv_heads heads.
    """

    supports_cache = True
    reads_grouped_kv = True

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        out = full_attention(q, k, v, mask=mask, causal=self.causal)
        batch, heads, length, dim = q.shape
        flops = full_attention_flops(batch, heads, length, length, dim, self.causal, mask is not None)
        return out, flops

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        k_all, v_all, key_start = append_keys_values(cache, k, v)
        return cached_softmax_attention(q, k_all, v_all, start, key_start)

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        return key_value_bytes(cache), True
