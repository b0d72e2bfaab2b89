"""`linear`: multi-head linear attention with the elu + 1 feature map, O(T·d²) time."""

from __future__ import annotations

from torch import Tensor

from routeformer.attention.base import AttentionLayer, live_bytes
from routeformer.attention.registry import register_attention
from routeformer.ops._checks import check_positive
from routeformer.ops.decode import linear_attention_step, start_linear_state
from routeformer.ops.grouped_heads import repeat_kv
from routeformer.ops.linear import DEFAULT_EPS, feature_map, linear_attention, linear_attention_flops


@register_attention("linear", every_parameter_used=True)
class LinearAttention(AttentionLayer):
    """Katharopoulos et al. (2020) linear attention; causal runs chunk by chunk (`chunk` tokens).
    Cached decoding carries the d×d state, O(1) per token.

    Args (beyond dim, heads, causal): chunk (tokens per chunk of the causal kernel, default 64),
    eps (the normaliser's floor, default ops.linear.DEFAULT_EPS), and the common options of
    `AttentionLayer` (head_dim, bias, rotary, rotary_base, kv_heads). kv_heads < heads: the
    parameters and the decoding state hold kv_heads heads (one state per K/V head, read by its
    group's query heads without a copy); the parallel pass repeats each K/V head for its query heads
    at call time (the chunked kernel takes one head count), a copy of K/V per query head.
    """

    supports_cache = True
    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, chunk: int = 64,
        eps: float = DEFAULT_EPS, **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        check_positive("chunk", chunk)
        if not eps > 0:
            raise ValueError(f"eps must be > 0; got {eps!r}")
        self.chunk, self.eps = chunk, eps

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
        out = linear_attention(q, k, v, mask=mask, causal=self.causal, chunk=self.chunk, eps=self.eps)
        batch, heads, length, dim = q.shape
        flops = linear_attention_flops(batch, heads, length, dim, v.shape[-1], self.causal, self.chunk)
        return out, flops

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        if "state" not in cache:  # a prefill: the chunked kernel (a step is quadratic in its tokens)
            start_linear_state(feature_map(k), v, cache)
            return self.attend(q, k, v, None)[0]
        return linear_attention_step(feature_map(q), feature_map(k), v, cache, self.eps)

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        return live_bytes(cache["state"]) + live_bytes(cache["normaliser"]), True
