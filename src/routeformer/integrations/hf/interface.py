"""routeformer as one of transformers' attention implementations: `attn_implementation="routeformer"`.

`register()` adds `routeformer_attention` to `transformers.AttentionInterface` and a mask function
to `transformers.AttentionMaskInterface`, both under `NAME`. A model whose attention modules call
the interface (`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`: Llama,
GPT-2, DeepSeek-V3.2 and most transformers decoders) then runs routeformer's attention when built or
loaded with `attn_implementation="routeformer"`. No weights change: this serves the model's own
attention. Mechanisms with trained parameters of their own (topk routing, mita, ...) go through
`patch_attention` instead (patch.py).

What the function computes:
- a call with `indices` (DeepSeek-V3.2's sparse attention: its indexer picks `index_topk` keys per
  query and passes them, int32 [B, S, topk], to every implementation other than eager/sdpa): each
  query attends to exactly those keys, through ops.topk.gathered.routed_attention (the C kernel on
  CPU, the Triton kernel on CUDA). A selected key counts only where the attention mask allows it
  (causal rule, padding), and entries outside [0, kv_length) are dropped: the keys that eager's
  mask (selection AND attention mask) keeps. A query row with no allowed key returns zeros.
- a call without `indices`: dense attention, transformers' own SDPA function with the mask it
  passes (the registered mask function is transformers' SDPA mask: None for a plain causal batch,
  a bool [B, 1, S, T] mask otherwise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NAME = "routeformer"


def _masked_value(mask: Tensor) -> Tensor:
    """True where an attention mask (bool: True = attend; float: additive, 0 = attend) blocks."""
    if mask.dtype == torch.bool:
        return ~mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if bool((~blocked & (mask != 0)).any()):
        raise ValueError("routeformer attention with indices takes a bool or 0/-inf attention mask; "
                         "got an additive float mask with other values (a score bias it cannot apply)")
    return blocked


def _allowed_slots(index: Tensor, attention_mask: Tensor | None, q_length: int, kv_length: int) -> Tensor:
    """valid [B, Hm, S, K] (Hm = the mask's head dim, 1 without a mask): slot in range and allowed."""
    in_range = (index >= 0) & (index < kv_length)
    safe = index.clamp(0, kv_length - 1)
    if attention_mask is None:  # plain causal: query s sits at position kv_length - q_length + s
        positions = torch.arange(kv_length - q_length, kv_length, device=index.device).view(1, -1, 1)
        return (in_range & (safe <= positions)).unsqueeze(1)
    if attention_mask.dim() != 4 or attention_mask.shape[-2] != q_length \
            or attention_mask.shape[-1] < kv_length:
        raise ValueError(f"attention_mask must be [B, 1 or H, {q_length}, >= {kv_length}]; "
                         f"got {tuple(attention_mask.shape)}")
    blocked = _masked_value(attention_mask[..., :kv_length])  # [B or 1, Hm, S, T]
    blocked = blocked.expand(index.shape[0], -1, -1, -1)
    heads = blocked.shape[1]
    gathered = blocked.gather(-1, safe.unsqueeze(1).expand(-1, heads, -1, -1))
    return in_range.unsqueeze(1) & ~gathered


def indexed_attention(query: Tensor, key: Tensor, value: Tensor, indices: Tensor,
                      attention_mask: Tensor | None, scaling: float | None = None) -> Tensor:
    """Attention of each query over the keys `indices` names, allowed by `attention_mask`.

    query [B, H, S, d], key [B, Hkv, T, d], value [B, Hkv, T, e] (H a multiple of Hkv; query head
    h reads K/V head h // (H / Hkv), as transformers' repeat_kv lays them out), indices int
    [B, S, K] (shared by all heads), attention_mask None (causal, the S queries
    being the last S of the T positions), bool [B, 1 or H, S, T] (True = attend) or additive float
    (0 / very negative). scaling: the softmax scale (default d ** -0.5). Returns [B, H, S, e]; a
    row with no allowed key is zeros. Raises ValueError on shapes that do not fit.
    """
    batch, heads, q_length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[-1] != dim or value.shape[:3] != key.shape[:3] \
            or heads % kv_heads:
        raise ValueError(f"query [B, H, S, d], key [B, Hkv, T, d], value [B, Hkv, T, e] with H a multiple "
                         f"of Hkv; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if indices.dim() != 3 or indices.shape[0] != batch or indices.shape[1] != q_length:
        raise ValueError(f"indices must be [B, S, K] with B, S = {batch}, {q_length}; "
                         f"got {tuple(indices.shape)}")
    from routeformer.ops.topk.gathered import routed_attention

    slots = indices.shape[-1]
    index = indices.long()
    valid = _allowed_slots(index, attention_mask, q_length, kv_length)  # [B, 1 or H, S, K]
    if valid.shape[1] not in (1, heads):
        raise ValueError(f"attention_mask has {valid.shape[1]} heads; 1 or {heads} allowed")
    index = index.unsqueeze(1)
    index = index.clamp(0, kv_length - 1).expand(batch, heads, q_length, slots)
    valid = valid.expand(batch, heads, q_length, slots)
    group = heads // kv_heads
    # The query heads of one K/V group become extra query rows of that K/V head: the keys and
    # values are read as they are, never repeated per query head.
    q_rows = query.reshape(batch, kv_heads, group * q_length, dim)
    index = index.reshape(batch, kv_heads, group * q_length, slots)
    valid = valid.reshape(batch, kv_heads, group * q_length, slots)
    out, _ = routed_attention(q_rows, key, value, index, valid, scale=scaling)
    return out.view(batch, heads, q_length, value.shape[-1])


def routeformer_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, indices: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature (AttentionInterface): returns (out [B, S, H, e], None).

    query [B, H, S, d], key/value [B, Hkv, T, d/e] as the model's attention module passes them.
    With `indices` (int [B, S, K]) the indexed path (module docstring); without, transformers'
    SDPA function. Raises ValueError, naming the setting, for what the indexed path cannot honour:
    dropout > 0, `softcap`, `sliding_window`, `output_attentions`.
    """
    if indices is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    for setting in ("softcap", "sliding_window"):
        if kwargs.get(setting) is not None:
            raise ValueError(f"routeformer attention with indices does not support {setting}="
                             f"{kwargs[setting]!r}; use attn_implementation='eager'")
    if dropout:
        raise ValueError(f"routeformer attention with indices does not support attention dropout "
                         f"(dropout={dropout}); call model.eval() or set attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise ValueError("routeformer attention does not return attention weights "
                         "(output_attentions=True); use attn_implementation='eager'")
    out = indexed_attention(query, key, value, indices, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `routeformer_attention` and its mask function (transformers' SDPA mask) under NAME
    with transformers' AttentionInterface and AttentionMaskInterface; idempotent. Returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, routeformer_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
