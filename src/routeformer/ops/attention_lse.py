"""Softmax attention that also returns its log-sum-exp, so partial results can be merged.

Axes: B batch, H heads (any leading axes in the reference), Lq queries, Lk keys, d / e dims.

    out = softmax(q kᵀ·scale + bias) v,   lse = log Σ_k exp(q kᵀ·scale + bias)

Attention split over disjoint key sets is recombined exactly by `merge_partials` (the online-softmax
rule): out = Σ_i exp(lse_i − logsumexp_j lse_j) out_i. Keys are excluded through `bias`, an additive
float mask; use `MASKED` (a large finite negative, so a row with no allowed key gets lse ≈ MASKED
and weight 0 in the merge, never a NaN; `masked_bias(dtype)` gives the value that fits fp16).

Fast path (any device and dtype): a blocked online softmax in public PyTorch ops — keys in blocks
of `DEFAULT_KEY_BLOCK`, running max and sum in fp32 (at least), so memory is O(Lq·block) beside
the inputs, never O(Lq·Lk) — and a backward that recomputes each block's weights from the lse
and folds the lse gradient g into D = rowsum(dO∘O) − g (the score gradient is P∘(dO vᵀ − D)).
With `use_kernel=False`, `attention_with_lse_reference` runs: dense scores and `torch.logsumexp`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.backends import TRITON, merge_partials_backend

MASKED = -1e30  # bias of an excluded key: finite, so an all-excluded row stays NaN-free


def masked_bias(dtype: torch.dtype) -> float:
    """`MASKED`, or half of the dtype's lowest value where -1e30 does not fit (fp16: -32752, whose
    exp is still exactly 0, and a score added to it does not overflow to -inf)."""
    return max(MASKED, torch.finfo(dtype).min / 2)

DEFAULT_KEY_BLOCK = 256  # keys per step of the blocked pass: scores [.., Lq, 256] at a time


def attention_with_lse_reference(
    q: Tensor, k: Tensor, v: Tensor, *, bias: Tensor | None = None, causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The specification: dense scores (+ bias, + the causal triangle), softmax, logsumexp."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if causal:
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, masked_bias(scores.dtype))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _summed(t: Tensor, leading: torch.Size) -> Tensor:
    """t summed over the leading axes that were broadcast from `leading` (a gradient's shape)."""
    return t if t.shape[:-2] == leading else t.sum_to_size(*leading, *t.shape[-2:])


def _leading_shape(q: Tensor, k: Tensor, bias: Tensor | None) -> torch.Size:
    """The scores' leading axes: q's, k's and the bias's broadcast together."""
    return torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], *(() if bias is None else (bias.shape[:-2],)))


def _block_logits(q: Tensor, k: Tensor, bias: Tensor | None, causal: bool, scale: float, lo: int,
                  hi: int) -> Tensor:
    """Scores of q (already in the work dtype) against keys [lo, hi), in the work dtype, with the
    bias's columns [lo, hi) (or its broadcast column) and the causal triangle (query i reads j <= i)."""
    work = q.dtype
    scores = (q @ k[..., lo:hi, :].to(work).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + (bias if bias.shape[-1] == 1 else bias[..., lo:hi]).to(work)
    if causal:
        rows = torch.arange(q.shape[-2], device=q.device)[:, None]
        ahead = torch.arange(lo, hi, device=q.device)[None, :] > rows
        scores = scores.masked_fill(ahead, masked_bias(work))
    return scores


def lse_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float,
                block: int | None = None) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse in the work dtype) by an online softmax over blocks of `block` keys:
    scores, weights and the running sums in fp32 (at least), memory O(Lq·block + Lq·e) beside the
    inputs (`block` defaults to DEFAULT_KEY_BLOCK). No autograd (see `lse_backward`)."""
    block = block or DEFAULT_KEY_BLOCK
    work = _work_dtype(q.dtype)
    queries = q.to(work)
    shape = _leading_shape(q, k, bias)
    row_max = queries.new_full((*shape, q.shape[-2]), float("-inf"))
    total = queries.new_zeros((*shape, q.shape[-2]))
    acc = queries.new_zeros((*shape, q.shape[-2], v.shape[-1]))
    for lo in range(0, k.shape[-2], block):
        hi = min(lo + block, k.shape[-2])
        scores = _block_logits(queries, k, bias, causal, scale, lo, hi)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        correction = torch.exp(row_max - new_max)  # exp(-inf) = 0 on the first block
        weights = torch.exp(scores - new_max[..., None])
        total = total * correction + weights.sum(dim=-1)
        acc = acc * correction[..., None] + weights @ v[..., lo:hi, :].to(work)
        row_max = new_max
    if k.shape[-2] == 0:  # no keys: zeros and lse = -inf, as the reference
        return acc.to(q.dtype), row_max
    return (acc / total[..., None]).to(q.dtype), row_max + total.log()


def lse_backward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float,
                 out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None,
                 block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v) in the inputs' dtypes, recomputing each key block's weights from
    the lse (FlashAttention's backward): with D = rowsum(dO∘O) − g_lse, dS = P∘(dO vᵀ − D), since
    ∂lse/∂s = P. Memory O(Lq·block) beside the inputs and the gradients."""
    block = block or DEFAULT_KEY_BLOCK
    work = _work_dtype(q.dtype)
    queries, grad_out = q.to(work), grad_out.to(work)
    delta = (grad_out * out.to(work)).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(work)
    shape = _leading_shape(q, k, bias)
    grad_q = queries.new_zeros((*shape, *q.shape[-2:]))
    grad_k = k.new_zeros(k.shape, dtype=work)
    grad_v = v.new_zeros(v.shape, dtype=work)
    for lo in range(0, k.shape[-2], block):
        hi = min(lo + block, k.shape[-2])
        weights = torch.exp(_block_logits(queries, k, bias, causal, scale, lo, hi) - lse.to(work)[..., None])
        values = v[..., lo:hi, :].to(work)
        grad_v[..., lo:hi, :] = _summed(weights.transpose(-1, -2) @ grad_out, v.shape[:-2])
        grad_scores = weights * (grad_out @ values.transpose(-1, -2) - delta[..., None]) * scale
        grad_q += grad_scores @ k[..., lo:hi, :].to(work)
        grad_k[..., lo:hi, :] = _summed(grad_scores.transpose(-1, -2) @ queries, k.shape[:-2])
    return _summed(grad_q, q.shape[:-2]).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _BlockedWithLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, causal, scale):
        out, lse = lse_forward(q, k, v, bias, causal, scale)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grads = lse_backward(q, k, v, bias, ctx.causal, ctx.scale, out, lse, grad_out, grad_lse)
        return (*grads, None, None, None)


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, *, bias: Tensor | None = None, causal: bool = False,
    scale: float | None = None, use_kernel: bool = True,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, Lq, e], lse [B, H, Lq]) of softmax attention over q [B, H, Lq, d], k [B, H, Lk, d],
    v [B, H, Lk, e]; `bias` broadcasts to [B, H, Lq, Lk]; `causal` lets query i read keys j <= i.
    The fast path is the blocked online softmax (`lse_forward`/`lse_backward`, O(Lq·block)
    memory, any device); `use_kernel=False` runs the dense reference. fp16/bf16 inputs are computed
    in fp32: out comes back in the input dtype, lse stays fp32."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, L, d]; got {tuple(tensor.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if bias is not None and bias.dtype in (torch.float16, torch.bfloat16):
        # A bias that fp16 rounded to -inf brought back to MASKED, so an all-excluded row stays finite.
        bias = bias.float().clamp_min(MASKED)
    if not use_kernel:
        if q.dtype in (torch.float16, torch.bfloat16):
            out, lse = attention_with_lse_reference(q.float(), k.float(), v.float(), bias=bias, causal=causal,
                                                    scale=scale)
            return out.to(q.dtype), lse
        return attention_with_lse_reference(q, k, v, bias=bias, causal=causal, scale=scale)
    return _BlockedWithLse.apply(q, k, v, bias, causal, scale)


def merge_partials(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Online-softmax merge of (out [..., e], lse [...]) computed over disjoint key sets; the weights
    and the sum are fp32 (at least), the result in the parts' dtype."""
    if merge_partials_backend(parts[0][0])[0] == TRITON:
        from routeformer.ops.triton.lse_merge import triton_merge_partials  # triton is optional

        return triton_merge_partials(parts)
    dtype = parts[0][0].dtype
    work = torch.promote_types(dtype, torch.float32)
    lses = torch.stack([lse.to(work) for _, lse in parts], dim=-1)
    weights = torch.softmax(lses, dim=-1)
    return sum(weights[..., i:i + 1] * out.to(work) for i, (out, _) in enumerate(parts)).to(dtype)
