"""`meta_tokens`: causal self-attention plus meta-attention among meta-token positions (Shah et al.,
"Language Modeling with Learned Meta-Tokens", arXiv 2509.16278).

Two forms, chosen by `meta_input`:

- `"sequential"` (default, the paper's layout: causal self-attention, *then* a meta-attention
  layer with its own projections):

      a   = W_o · Attn_causal(x)
      out = a + [meta] · g · W_o' · Attn_meta(W_q', W_k', W_v' applied to x + a)

  The meta-attention reads the residual stream after the standard attention, so a meta-token
  already carries its context when the meta-tokens exchange it. Needs `meta_projections="separate"`
  (it owns W_q', W_k', W_v' and W_o').
- `"parallel"` (the earlier form): out = W_o( Attn_causal(x) + [meta] · g · Attn_meta(x) ), both
  reading the block input x, with the standard Q/K/V (`"shared"`) or its own (`"separate"`).
  Its defect: in the first layer every meta-token holds the same input (the `_PAUSE_` embedding;
  rotary only turns q and k), so all values among meta-tokens are equal and Attn_meta returns the
  same vector at every meta position whatever the context (tests/attention/test_meta_tokens.py
  shows it, and shows the sequential form does not).

Attn_meta lets a meta-token (`_PAUSE_`) read only earlier meta-tokens; it is zero at ordinary
tokens. The combination g is 1 for `combine="add"` (the paper's) or sigmoid(w_h · x + b_h) per head
and meta-token for `combine="gated"` (ours: lets a head switch the meta path off). The packed op
(ops/meta_tokens.py) costs O(M²) for M meta-tokens, not O(T²).

Which tokens are meta-tokens: the backbone passes `meta_mask` [B, T] (True at `_PAUSE_`, from
`ModelConfig.meta_token_id`). Called without one, the layer is plain causal attention. Positions at
meta-tokens: see tasks/meta_tokens.py (`meta_positions`: keep, skip, or the paper's zeroing, which
breaks shift invariance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from routeformer.attention.base import AttentionLayer, AttentionOutput
from routeformer.attention.registry import register_attention
from routeformer.ops.decode import allowed_cached, append_keys_values, cached_softmax_attention
from routeformer.ops.full import full_attention
from routeformer.ops.grouped_heads import repeat_kv
from routeformer.ops.meta_tokens import (
    attention_among_meta,
    gather_rows,
    meta_token_attention,
    meta_token_attention_flops,
    pack_meta_positions,
)

COMBINE_KINDS = ("add", "gated")
PROJECTION_KINDS = ("shared", "separate")
INPUT_KINDS = ("sequential", "parallel")


@register_attention("meta_tokens", needs_meta_tokens=True)
class MetaTokensAttention(AttentionLayer):
    """Causal self-attention plus meta-attention among meta-tokens (see the module docstring).

    Args (beyond dim, heads, causal): combine ("add" | "gated", default "add"), meta_projections
    ("separate" | "shared", default "separate"), meta_input ("sequential" | "parallel", default
    "sequential"), and the common options of `AttentionLayer` (head_dim, bias, rotary,
    rotary_base, kv_heads). kv_heads < heads applies to both attentions (the standard and the
    meta projections hold kv_heads K/V heads, and so does the decode cache); the standard
    attention of the sequential form and every cached step read the K/V heads in place (SDPA's
    `enable_gqa`), while the packed meta-token op of the parallel form and the attention among
    meta rows take one head count and get each K/V head repeated for its query heads at call time
    (a copy of K/V per query head).
    """

    # The backbone hands this layer the meta-token mask (layers without the flag never see it).
    reads_meta_mask = True
    supports_cache = True
    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, combine: str = "add",
        meta_projections: str = "separate", meta_input: str = "sequential", **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        if combine not in COMBINE_KINDS:
            raise ValueError(f"combine must be one of {COMBINE_KINDS}; got {combine!r}")
        if meta_projections not in PROJECTION_KINDS:
            raise ValueError(f"meta_projections must be one of {PROJECTION_KINDS}; got {meta_projections!r}")
        if meta_input not in INPUT_KINDS:
            raise ValueError(f"meta_input must be one of {INPUT_KINDS}; got {meta_input!r}")
        if meta_input == "sequential" and meta_projections != "separate":
            raise ValueError("meta_input='sequential' reads the stream after the standard attention with "
                             "its own projections: meta_projections must be 'separate' (or pass "
                             f"meta_input='parallel'); got {meta_projections!r}")
        self.combine, self.meta_projections, self.meta_input = combine, meta_projections, meta_input
        inner = self.heads * self.head_dim
        qkv_width = inner + 2 * self.kv_heads * self.head_dim  # q's heads, then kv_heads for k and v
        self.meta_qkv_proj = nn.Linear(dim, qkv_width, bias=False) if meta_projections == "separate" else None
        self.meta_out_proj = nn.Linear(inner, dim, bias=False) if meta_input == "sequential" else None
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
        # Packing first: its graph break (data-dependent width) then splits nothing that matters,
        # and the projections, both attentions and their backward compile as one graph.
        packing = pack_meta_positions(meta_mask, mask)
        q, k, v = self.project_qkv(x, positions)
        flops = meta_token_attention_flops(q, packing, masked=mask is not None, causal=self.causal)
        # tensors, not host reads (each read would break a compiled graph)
        real = torch.tensor(float(x.shape[0] * x.shape[1])) if mask is None else mask.sum().float()
        stats = {"flops": torch.tensor(float(flops)),
                 "meta_fraction": packing.counts.sum().float() / real.to(packing.counts.device).clamp_min(1)}
        if self.meta_input == "sequential":
            out = self._sequential(x, q, k, v, packing, mask, positions)
            return AttentionOutput(out=out, aux_loss=x.new_zeros(()), stats=stats)
        meta_qkv = meta_gate = None
        if packing.width and (self.meta_qkv_proj is not None or self.gate_proj is not None):
            rows = gather_rows(x, packing.index)  # [B, M, D]: the meta rows only
            if self.meta_qkv_proj is not None:
                meta_qkv = self._project_rows(rows, positions.gather(1, packing.index))
            if self.gate_proj is not None:
                meta_gate = self.gate_proj(rows).sigmoid().transpose(1, 2)[..., None]  # [B, H, M, 1]
        # The op takes one head count: K/V repeated per query head at call time (kv_heads < heads).
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
        if meta_qkv is not None:
            meta_qkv = (meta_qkv[0], repeat_kv(meta_qkv[1], self.heads), repeat_kv(meta_qkv[2], self.heads))
        heads_out = meta_token_attention(q, k, v, packing, mask=mask, causal=self.causal,
                                         meta_qkv=meta_qkv, meta_gate=meta_gate)
        return AttentionOutput(out=self.out_proj(self.merge_heads(heads_out, x)), aux_loss=x.new_zeros(()),
                               stats=stats)

    def _sequential(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, packing, mask: Tensor | None,
                    positions: Tensor) -> Tensor:
        """The paper's layout: standard attention, then meta-attention on x + its output (meta rows)."""
        standard = self.out_proj(self.merge_heads(full_attention(q, k, v, mask=mask, causal=self.causal), x))
        if packing.width == 0:
            return standard
        rows = gather_rows(x + standard, packing.index)  # [B, M, D]: the stream at the meta rows
        meta_q, meta_k, meta_v = self._project_rows(rows, positions.gather(1, packing.index))
        meta_k, meta_v = repeat_kv(meta_k, self.heads), repeat_kv(meta_v, self.heads)
        meta_heads = attention_among_meta(meta_q, meta_k, meta_v, packing.valid, self.causal)
        if self.gate_proj is not None:
            meta_heads = meta_heads * self.gate_proj(rows).sigmoid().transpose(1, 2)[..., None]
        meta_rows = self.meta_out_proj(meta_heads.transpose(1, 2).flatten(2))  # [B, M, D]
        # Filler slots (valid False) point at position 0: where(), not a product, keeps them out.
        meta_rows = torch.where(packing.valid[..., None], meta_rows, 0.0)
        batch, length = standard.shape[:2]
        rows_at = packing.index + torch.arange(batch, device=x.device)[:, None] * length  # flat row ids
        added = standard.flatten(0, 1).index_add(0, rows_at.flatten(), meta_rows.flatten(0, 1))
        return added.view_as(standard)

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
        if self.meta_input == "sequential":
            standard = self.out_proj(self.merge_heads(heads_out, x))
            stream = x + standard  # the meta projections read the stream after the standard attention
            q, k, v = self._project_rows(stream, positions)
            k, v, _ = append_keys_values(cache, k, v, prefix="meta_")
            if not bool(meta_mask.any()):
                return standard
            meta_heads = self._cached_meta_attention(q, k, v, meta_keys, meta_mask, start, stream)
            meta_out = self.meta_out_proj(meta_heads.transpose(1, 2).flatten(2))
            return standard + meta_out * meta_mask[..., None].to(meta_out.dtype)
        if self.meta_qkv_proj is not None:
            q, k, v = self._project_rows(x, positions)
            k, v, _ = append_keys_values(cache, k, v, prefix="meta_")
        else:
            k, v = k_all, v_all
        if bool(meta_mask.any()):
            meta_out = self._cached_meta_attention(q, k, v, meta_keys, meta_mask, start, x)
            heads_out = heads_out + meta_out * meta_mask[:, None, :, None].to(meta_out.dtype)
        return self.out_proj(self.merge_heads(heads_out, x))

    def _cached_meta_attention(self, q: Tensor, k: Tensor, v: Tensor, meta_keys: Tensor, meta_mask: Tensor,
                               start: int, gate_input: Tensor) -> Tensor:
        """Meta-attention of the new rows over the cached keys, [B, H, L, d] (meaningful at meta rows)."""
        device, length = q.device, q.shape[2]
        causal = allowed_cached(torch.arange(start, start + length, device=device),
                                torch.arange(start + length, device=device))
        # Meta queries read meta keys only; other rows get the causal mask (never empty) and
        # their meta output is dropped by the caller.
        allowed = causal & (meta_keys[:, None, :] | ~meta_mask[:, :, None])
        meta_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None],
                                                  enable_gqa=q.shape[1] != k.shape[1])
        if self.gate_proj is not None:
            meta_out = meta_out * self.gate_proj(gate_input).sigmoid().transpose(1, 2)[..., None]
        return meta_out

    def _project_rows(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.split_projection(self.meta_qkv_proj(rows), positions)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, combine={self.combine}, meta_projections={self.meta_projections}, "
                f"meta_input={self.meta_input}")
