"""`local`: multi-head sliding-window attention, blockwise, O(T·window·d) time."""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.attention.base import AttentionLayer, AttentionOutput, key_value_bytes
from routeformer.attention.registry import register_attention
from routeformer.ops._checks import check_positive
from routeformer.ops.decode import append_keys_values, cached_softmax_attention, trim_keys_values
from routeformer.ops.documents import document_positions
from routeformer.ops.grouped_heads import repeat_kv
from routeformer.ops.local import local_attention, local_attention_flops


@register_attention("local", every_parameter_used=True)
class LocalAttention(AttentionLayer):
    """Each token attends to `window` tokens: [i - window + 1, i] causal, [i - window, i + window]
    otherwise. `block` sets the query block length of the blockwise kernel (default min(window, 128)).
    Cached decoding keeps only the last window - 1 keys. Packed `documents`: one blockwise call
    with the window cut at document boundaries (`forward_documents`).

    Args (beyond dim, heads, causal): window (keys per query, default 256), block (query block of
    the blockwise kernel, default min(window, 128)), and the common options of `AttentionLayer`
    (head_dim, bias, rotary, rotary_base, kv_heads). kv_heads < heads: the parameters and the
    decode cache hold kv_heads heads and cached steps read them in place (SDPA's `enable_gqa`);
    the parallel pass (the C kernel and the blockwise path take one head count) repeats each K/V
    head for its query heads at call time, a copy of K/V per query head.
    """

    supports_cache = True
    reads_grouped_kv = True

    def __init__(
        self, dim: int, heads: int, causal: bool = True, *, window: int = 256,
        block: int | None = None, **common,
    ) -> None:
        super().__init__(dim, heads, causal, **common)
        check_positive("window", window)
        if block is not None:
            check_positive("block", block)
        self.window, self.block = window, block

    @classmethod
    def budget_options(cls, seq_len: int, keys: int) -> dict[str, int]:
        """A window of T/4 keys, up to `keys` (fixed from T = 4·keys on)."""
        return {"window": max(1, min(seq_len // 4, keys))}

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, int]:
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
        out = local_attention(
            q, k, v, window=self.window, mask=mask, causal=self.causal, block=self.block
        )
        batch, heads, length, dim = q.shape
        flops = local_attention_flops(batch, heads, length, dim, self.window, self.causal, self.block)
        return out, flops

    def forward_documents(
        self, x: Tensor, *, mask: Tensor | None, positions: Tensor | None, documents: Tensor, **extra
    ) -> AttentionOutput:
        """Packed documents in one call: the window stops at the document's start (and end), via the
        blockwise kernel's band mask (ops/local/op.py); positions restart at 0 in each document."""
        mask, _ = self.check_inputs(x, mask, positions)
        if positions is None:
            positions = document_positions(documents)
        q, k, v = self.project_qkv(x, positions)
        k, v = repeat_kv(k, self.heads), repeat_kv(v, self.heads)
        heads_out = local_attention(q, k, v, window=self.window, mask=mask, causal=self.causal,
                                    block=self.block, documents=documents)
        batch, heads, length, dim = q.shape
        flops = local_attention_flops(batch, heads, length, dim, self.window, self.causal, self.block,
                                      native=False)
        out = self.out_proj(self.merge_heads(heads_out, x))
        return AttentionOutput(out=out, aux_loss=x.new_zeros(()), stats={"flops": torch.tensor(float(flops))})

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: dict) -> Tensor:
        keep = self.window - 1  # the keys a later query can still read
        if "k" not in cache:  # a prefill: the blockwise kernel, not a T×T mask
            out = self.attend(q, k, v, None)[0]
            kept = min(keep, k.shape[2])
            # Only the last window - 1 keys are cached: the buffer holds 2·window rows, whatever the
            # prompt's length, and the live rows move back to its start every ~window steps.
            cache["start"] = start + k.shape[2] - kept
            append_keys_values(cache, k[:, :, k.shape[2] - kept:], v[:, :, k.shape[2] - kept:],
                               capacity=2 * self.window)
        else:
            k_all, v_all, key_start = append_keys_values(cache, k, v)
            out = cached_softmax_attention(q, k_all, v_all, start, key_start, window=self.window)
        trim_keys_values(cache, keep)
        return out

    def decode_read_bytes(self, cache: dict) -> tuple[int, bool]:
        return key_value_bytes(cache), True  # the live window: the cache keeps only window - 1 keys

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window={self.window}"
