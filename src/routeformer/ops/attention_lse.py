"""Softmax attention that also returns its log-sum-exp, so partial results can be merged.

Axes: B batch, H heads (any leading axes in the reference), Lq queries, Lk keys, d / e dims.

    out = softmax(q kᵀ·scale + bias) v,   lse = log Σ_k exp(q kᵀ·scale + bias)

Attention split over disjoint key sets is recombined exactly by `merge_partials` (the online-softmax
rule): out = Σ_i exp(lse_i − logsumexp_j lse_j) out_i. Keys are excluded through `bias`, an additive
float mask; use `MASKED` (a large finite negative, so a row with no allowed key gets lse ≈ MASKED
and weight 0 in the merge, never a NaN; `masked_bias(dtype)` gives the value that fits fp16).

Fast path (CPU): PyTorch's fused flash kernel, which computes the lse anyway. Its backward has no
lse input, so the lse gradient g is folded in through one extra value column: with v' = [v, 0],
out' = [out, −g] and grad_out' = [dO, 1], the kernel's D = rowsum(grad_out'·out') becomes
rowsum(dO·out) − g, which is exactly the score gradient P∘(dO vᵀ − D + g). Elsewhere (or with
`use_kernel=False`) `attention_with_lse_reference` runs: dense scores and `torch.logsumexp`.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASKED = -1e30  # bias of an excluded key: finite, so an all-excluded row stays NaN-free


def masked_bias(dtype: torch.dtype) -> float:
    """`MASKED`, or half of the dtype's lowest value where -1e30 does not fit (fp16: -32752, whose
    exp is still exactly 0, and a score added to it does not overflow to -inf)."""
    return max(MASKED, torch.finfo(dtype).min / 2)

_KERNEL = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_KERNEL_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


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


class _FlashWithLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, causal, scale):
        out, lse = _KERNEL(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            grad_q, grad_k, grad_v = _KERNEL_BACKWARD(
                grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.causal, attn_mask=bias, scale=ctx.scale)
            return grad_q, grad_k, grad_v, None, None, None
        # The kernel wants one head size for q, k and v: q and k get a zero column too (scores
        # unchanged; the scale is passed explicitly).
        def widen(t: Tensor, column: Tensor) -> Tensor:
            return torch.cat([t, column], dim=-1)

        grad_out = widen(grad_out, out.new_ones(*out.shape[:-1], 1))
        out = widen(out, -grad_lse.to(out.dtype)[..., None])
        q, k, v = (widen(t, torch.zeros_like(t[..., :1])) for t in (q, k, v))
        grad_q, grad_k, grad_v = _KERNEL_BACKWARD(
            grad_out, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=bias, scale=ctx.scale)
        return grad_q[..., :-1], grad_k[..., :-1], grad_v[..., :-1], None, None, None


def flash_kernel_fits(q: Tensor, v: Tensor) -> bool:
    """Whether PyTorch's CPU flash kernel (and its backward) can run these tensors: CPU, fp32/fp64,
    one head size for q, k and v."""
    return (_KERNEL is not None and _KERNEL_BACKWARD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64) and q.shape[-1] == v.shape[-1])


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, *, bias: Tensor | None = None, causal: bool = False,
    scale: float | None = None, use_kernel: bool = True,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, Lq, e], lse [B, H, Lq]) of softmax attention over q [B, H, Lq, d], k [B, H, Lk, d],
    v [B, H, Lk, e]; `bias` broadcasts to [B, H, Lq, Lk]; `causal` lets query i read keys j <= i.
    fp16/bf16 inputs are computed in fp32: out comes back in the input dtype, lse stays fp32."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have shape [B, H, L, d]; got {tuple(tensor.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.dtype in (torch.float16, torch.bfloat16):
        # Scores, softmax and lse in fp32 (the lse feeds merges that subtract large numbers), and a
        # bias that fp16 rounded to -inf brought back to MASKED, so an all-excluded row stays finite.
        if bias is not None:
            bias = bias.float().clamp_min(MASKED)
        out, lse = attention_with_lse(q.float(), k.float(), v.float(), bias=bias, causal=causal,
                                      scale=scale, use_kernel=use_kernel)
        return out.to(q.dtype), lse
    if use_kernel and flash_kernel_fits(q, v):
        if bias is not None:
            bias = bias.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).contiguous()
        return _FlashWithLse.apply(q.contiguous(), k.contiguous(), v.contiguous(), bias, causal, scale)
    return attention_with_lse_reference(q, k, v, bias=bias, causal=causal, scale=scale)


def merge_partials(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Online-softmax merge of (out [..., e], lse [...]) computed over disjoint key sets; the weights
    and the sum are fp32 (at least), the result in the parts' dtype."""
    dtype = parts[0][0].dtype
    work = torch.promote_types(dtype, torch.float32)
    lses = torch.stack([lse.to(work) for _, lse in parts], dim=-1)
    weights = torch.softmax(lses, dim=-1)
    return sum(weights[..., i:i + 1] * out.to(work) for i, (out, _) in enumerate(parts)).to(dtype)
