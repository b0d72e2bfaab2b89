"""`multihop`: attention whose values follow paths of up to n edges, (P + ... + Pⁿ) V.

Singh & Buckley, "Attention as Implicit Structural Inference" (NeurIPS 2023), §4: the attention
matrix is a posterior over the edges of a graph; reading the neighbour's neighbour too gives one
layer a bias that a single self-attention layer lacks (a two-hop chain). See
`routeformer.ops.multihop` for the forms and their differences.
"""

from __future__ import annotations

from torch import Tensor

from routeformer.attention.base import AttentionLayer, key_value_bytes, live_bytes
from routeformer.attention.registry import register_attention
from routeformer.ops.decode import append_keys_values, append_rows, cached_softmax_attention
from routeformer.ops.grouped_heads import repeat_kv
from routeformer.ops.multihop import (
    check_multihop_options,
    multihop_attention,
    multihop_attention_flops,
    path_settings,
)


@register_attention("multihop", every_parameter_used=True)
class MultihopAttention(AttentionLayer):
    """Multi-hop attention: out = W_o Σ_{h=1..hops} Pʰ V (+ V with `identity`).

    Options: `hops` (path length n, default 2 = the paper's P + P²); `identity` (add the zero-hop
    path; None = the form's default); `form` ("paper": the sum, any masking; "authors": the
    authors' code, the mean of I, P̃, P̃² with the softmax over the query axis, non-causal only).
    Same parameters as `full`; costs `hops` attention passes.

    Cached decoding (causal "paper" form) is the exact recurrence: hop h of token i is
    P_i · hop_{h-1}[0..i] (hop_0 = V), so the cache keeps the keys, the values and the outputs of
    hops 1 .. hops-1 of every token (hops + 1 tensors of [B, H, L, d]: hops - 1 more than `full`),
    and a step reads all of them, one attention pass per hop as in the parallel op.

    Common options of `AttentionLayer`: head_dim, bias, rotary, rotary_base, kv_heads. kv_heads <
    heads: the parameters and the cached keys and values hold kv_heads heads (the hop outputs are
    per query head, as each query head has its own P). The parallel op takes one head count, so it
    gets each K/V head repeated for its query heads at call time (a copy); a cached step's first hop
    reads the K/V heads in place (SDPA's `enable_gqa`), its later hops, whose values are per query
    head, read the keys repeated (a copy of the cached keys per step).
    """

    supports_cache = True
    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, hops: int = 2, identity: bool | None = None,
        form: str = "paper", **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        check_multihop_options(hops, form, causal)
        self.hops, self.identity, self.form = hops, identity, form

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
        out = multihop_attention(q, k, v, hops=self.hops, identity=self.identity, form=self.form,
                                 mask=mask, causal=self.causal)
        batch, heads, length, dim = q.shape
        flops = multihop_attention_flops(batch, heads, length, dim, self.hops, self.causal, mask is not None)
        return out, flops

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        # check_decode has refused non-causal layers; form "authors" is non-causal only.
        k_all, hop_all, key_start = append_keys_values(cache, k, v)
        identity, _ = path_settings(self.form, self.identity, self.hops)
        total = repeat_kv(v, self.heads) if identity else None
        for hop_number in range(1, self.hops + 1):
            if hop_number == 2:  # from here on the values are per query head
                k_all = repeat_kv(k_all, self.heads)
            hop = cached_softmax_attention(q, k_all, hop_all, start, key_start)
            total = hop if total is None else total + hop
            if hop_number < self.hops:  # the next hop reads this one's outputs, its own row included
                hop_all = append_rows(cache, {"v": hop}, prefix=f"hop{hop_number}_",
                                      capacity=cache.get("reserve") or None)["v"]
        return total

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        hops = [cache[f"hop{h}_v"] for h in range(1, self.hops)]
        return key_value_bytes(cache) + sum(map(live_bytes, hops)), True

    def extra_repr(self) -> str:
        return super().extra_repr() + f", hops={self.hops}, identity={self.identity}, form={self.form!r}"
