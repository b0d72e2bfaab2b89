"""`meta_tokens`: causal self-attention plus meta-attention among meta-token positions (Shah et al.,
"Language Modeling with Learned Meta-Tokens", arXiv 2509.16278).

    out = W_o( Attn_causal(x)  +  [meta] · g · Attn_meta(x) )

Attn_meta lets a meta-token (`_PAUSE_`) read only earlier meta-tokens; it is zero at ordinary
tokens. The combination g is

- `combine="add"` (default): g = 1. The paper adds the meta-attention to the standard attention
  output at meta positions; this is its combination.
- `combine="gated"`: g = sigmoid(w_h · x + b_h), one gate per head and meta-token (ours: lets a head
  switch the meta path off).

The meta-attention reuses the standard Q/K/V projections (`meta_projections="shared"`, as the paper
writes a single attention with an extra mask) or owns its own (`"separate"`, computed only at the
meta rows). The packed op (ops/meta_tokens.py) costs O(M²) for M meta-tokens, not O(T²).

Which tokens are meta-tokens: the backbone passes `meta_mask` [B, T] (True at `_PAUSE_`, from
`ModelConfig.meta_token_id`). Called without one, the layer is plain causal attention. Positional
encodings at meta positions are zeroed (or not) by the backbone; see models/transformer.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.registry import register_attention
from routeformer.ops.decode import allowed_cached, append_keys_values, cached_softmax_attention
from routeformer.ops.meta_tokens import (
    gather_rows,
    meta_token_attention,
    meta_token_attention_flops,
    pack_meta_positions,
)

COMBINE_KINDS = ("add", "gated")
PROJECTION_KINDS = ("shared", "separate")


@register_attention("meta_tokens")
class MetaTokensAttention(AttentionLayer):
    # The backbone hands this layer the meta-token mask (layers without the flag never see it).
    reads_meta_mask = True
    supports_cache = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, combine: str = "add",
        meta_projections: str = "shared", **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        if combine not in COMBINE_KINDS:
            raise ValueError(f"combine must be one of {COMBINE_KINDS}; got {combine!r}")
        if meta_projections not in PROJECTION_KINDS:
            raise ValueError(f"meta_projections must be one of {PROJECTION_KINDS}; got {meta_projections!r}")
        self.combine, self.meta_projections = combine, meta_projections
        inner = self.heads * self.head_dim
        self.meta_qkv_proj = nn.Linear(dim, 3 * inner, bias=False) if meta_projections == "separate" else None
        self.gate_proj = nn.Linear(dim, self.heads) if combine == "gated" else None

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, positions: Tensor | None = None,
        meta_mask: Tensor | None = None,
    ) -> AttentionOutput:
        mask, positions = self.check_inputs(x, mask, positions)
        if meta_mask is None:
            meta_mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        elif meta_mask.dtype != torch.bool or meta_mask.shape != x.shape[:2]:
            raise ValueError(f"meta_mask must be a bool tensor of shape [B, T] = {tuple(x.shape[:2])}; "
                             f"got {meta_mask.dtype} {tuple(meta_mask.shape)}")
        q, k, v = self.project_qkv(x, positions)
        packing = pack_meta_positions(meta_mask, mask)
        meta_qkv = meta_gate = None
        if packing.width and (self.meta_qkv_proj is not None or self.gate_proj is not None):
            rows = gather_rows(x, packing.index)  # [B, M, D]: the meta rows only
            if self.meta_qkv_proj is not None:
                meta_qkv = self._project_rows(rows, positions.gather(1, packing.index))
            if self.gate_proj is not None:
                meta_gate = self.gate_proj(rows).sigmoid().transpose(1, 2)[..., None]  # [B, H, M, 1]
        heads_out = meta_token_attention(q, k, v, packing, mask=mask, causal=self.causal,
                                         meta_qkv=meta_qkv, meta_gate=meta_gate)
        real = x.shape[0] * x.shape[1] if mask is None else int(mask.sum())
        flops = meta_token_attention_flops(q, packing, masked=mask is not None, causal=self.causal)
        return AttentionOutput(
            out=self.out_proj(self.merge_heads(heads_out, x)),
            aux_loss=x.new_zeros(()),
            stats={"flops": torch.tensor(float(flops)),
                   "meta_fraction": torch.tensor(float(packing.counts.sum()) / max(real, 1))},
        )

    def decode(self, x: Tensor, *, positions: Tensor, cache: dict, meta_mask: Tensor | None = None) -> Tensor:
        """Cached decoding (see AttentionLayer.decode). The cache keeps every token's keys/values and
        whether it is a meta-token; a new meta-token's meta-attention reads the cached meta keys (its
        own projections' keys, for "separate", kept for every token) through a mask — O(L) per
        token, like the standard attention beside it."""
        self.check_decode(x, positions)
        batch, length, _ = x.shape
        if meta_mask is None:
            meta_mask = torch.zeros(batch, length, dtype=torch.bool, device=x.device)
        start = cache.get("length", 0)
        q, k, v = self.project_qkv(x, positions)
        k_all, v_all, _ = append_keys_values(cache, k, v)
        heads_out = cached_softmax_attention(q, k_all, v_all, start, 0)
        meta_keys = torch.cat([cache["meta"], meta_mask], dim=1) if "meta" in cache else meta_mask
        cache["meta"], cache["length"] = meta_keys, start + length
        if self.meta_qkv_proj is not None:
            q, k, v = self._project_rows(x, positions)
            k, v, _ = append_keys_values(cache, k, v, prefix="meta_")
        else:
            k, v = k_all, v_all
        if bool(meta_mask.any()):
            device = x.device
            causal = allowed_cached(torch.arange(start, start + length, device=device),
                                    torch.arange(start + length, device=device))
            # Meta queries read meta keys only; other rows get the causal mask (never empty) and
            # their meta output is dropped below.
            allowed = causal & (meta_keys[:, None, :] | ~meta_mask[:, :, None])
            meta_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
            if self.gate_proj is not None:
                meta_out = meta_out * self.gate_proj(x).sigmoid().transpose(1, 2)[..., None]
            heads_out = heads_out + meta_out * meta_mask[:, None, :, None].to(meta_out.dtype)
        return self.out_proj(self.merge_heads(heads_out, x))

    def _project_rows(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch, width, _ = rows.shape
        qkv = self.meta_qkv_proj(rows).view(batch, width, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return self.rotate(q, positions), self.rotate(k, positions), v

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, combine={self.combine}, meta_projections={self.meta_projections}"
