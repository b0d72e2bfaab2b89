"""`multihop`: attention whose values follow paths of up to n edges, (P + ... + Pⁿ) V.

Singh & Buckley, "Attention as Implicit Structural Inference" (NeurIPS 2023), §4: the attention
matrix is a posterior over the edges of a graph; reading the neighbour's neighbour too gives one
layer a bias that a single self-attention layer lacks (a two-hop chain). See
`routeformer.ops.multihop` for the forms and their differences.
"""

from __future__ import annotations

from torch import Tensor

from routeformer.attention.base import AttentionLayer
from routeformer.attention.registry import register_attention
from routeformer.ops.multihop import (
    check_multihop_options,
    multihop_attention,
    multihop_attention_flops,
)


@register_attention("multihop")
class MultihopAttention(AttentionLayer):
    """Multi-hop attention: out = W_o Σ_{h=1..hops} Pʰ V (+ V with `identity`).

    Options: `hops` (path length n, default 2 = the paper's P + P²); `identity` (add the zero-hop
    path; None = the form's default); `form` ("paper": the sum, any masking; "authors": the
    authors' code, the mean of I, P̃, P̃² with the softmax over the query axis, non-causal only).
    Same parameters as `full`; costs `hops` attention passes.
    """

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, hops: int = 2, identity: bool | None = None,
        form: str = "paper", **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        check_multihop_options(hops, form, causal)
        self.hops, self.identity, self.form = hops, identity, form

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        out = multihop_attention(q, k, v, hops=self.hops, identity=self.identity, form=self.form,
                                 mask=mask, causal=self.causal)
        batch, heads, length, dim = q.shape
        flops = multihop_attention_flops(batch, heads, length, dim, self.hops, self.causal, mask is not None)
        return out, flops

    def extra_repr(self) -> str:
        return super().extra_repr() + f", hops={self.hops}, identity={self.identity}, form={self.form!r}"
