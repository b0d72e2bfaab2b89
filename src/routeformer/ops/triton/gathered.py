"""Triton kernel: attention over each query's gathered keys, forward and backward.

Axes: B batch, H heads, T queries, S keys, K slots per query, d key dim, e value dim.
Same contract as `routeformer.ops.topk.routed_attention` (its reference twin is
`routed_attention_reference`): `index` [B, H, T, K] names the keys each query reads, `valid` which
slots are real; a row with no valid slot returns zeros and lse = -inf.

    out_t = Σ_slot softmax_slot(q_t · k_index · scale) v_index,   lse_t = log Σ_slot exp(...)

One program serves a block of BLOCK_T queries of one (b, h): it walks the slots BLOCK_K at a time
with the online softmax (running max, running sum, rescaled accumulator), so registers hold
[BLOCK_T, BLOCK_K, d] and nothing of size T x S exists. Everything is accumulated in fp32 whatever
the input dtype. The backward recomputes the probabilities from the saved lse (FlashAttention's
recompute), writes grad_q per row and scatters grad_k / grad_v with fp32 atomic adds (several
queries read one key). Unlike the PyTorch op, lse here is differentiable: d lse / d logit = p, so
a gradient g on lse enters as delta − g in dS = P ∘ (dP − delta) — MiTA merges partial results by
their lse, and the merge's gradient flows through it. Slots may repeat a key (MiTA's experts can
overlap): a repeated key simply counts twice, as in MiTA's concatenation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from routeformer.ops.triton._common import (
    check_device,
    check_float,
    kernel,
    load_backward_rows,
    next_power_of_2,
)


@kernel
def _routed_forward_kernel(
    Q, K, V, IDX, VALID, OUT, LSE,
    heads, length, num_keys, slots, dim, value_dim, scale,
    si_b, si_h, si_t, sv_b, sv_h, sv_t,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B·H·T·d may pass 2³¹
    b = bh // heads
    h = bh % heads
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < length
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    d_ok = offs_d < dim
    e_ok = offs_e < value_dim
    q = tl.load(Q + bh * length * dim + rows[:, None] * dim + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    k_base = K + bh * num_keys * dim
    v_base = V + bh * num_keys * value_dim
    row_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for start in range(0, slots, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        cell_ok = row_ok[:, None] & (cols < slots)[None, :]
        idx = tl.load(IDX + b * si_b + h * si_h + rows[:, None] * si_t + cols[None, :], mask=cell_ok, other=0)
        ok = tl.load(VALID + b * sv_b + h * sv_h + rows[:, None] * sv_t + cols[None, :], mask=cell_ok,
                     other=0) != 0
        ok = ok & cell_ok
        keys = tl.load(k_base + idx[:, :, None] * dim + offs_d[None, None, :],
                       mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
        logits = tl.sum(q[:, None, :] * keys, axis=2) * scale
        logits = tl.where(ok, logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # an all-empty row so far
        alpha = tl.exp(row_max - safe_max)
        weights = tl.exp(logits - safe_max[:, None])
        total = total * alpha + tl.sum(weights, axis=1)
        values = tl.load(v_base + idx[:, :, None] * value_dim + offs_e[None, None, :],
                         mask=ok[:, :, None] & e_ok[None, None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * values, axis=1)
        row_max = new_max
    nonempty = total > 0.0
    out = acc / tl.where(nonempty, total, 1.0)[:, None]
    lse = tl.where(nonempty, row_max + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    tl.store(OUT + bh * length * value_dim + rows[:, None] * value_dim + offs_e[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & e_ok[None, :])
    tl.store(LSE + bh * length + rows, lse, mask=row_ok)


@kernel
def _routed_backward_kernel(
    Q, K, V, IDX, VALID, OUT, LSE, GRAD_OUT, GRAD_LSE, GRAD_Q, GRAD_K, GRAD_V,
    heads, length, num_keys, slots, dim, value_dim, scale,
    si_b, si_h, si_t, sv_b, sv_h, sv_t,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B·H·T·d may pass 2³¹
    b = bh // heads
    h = bh % heads
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < length
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    d_ok = offs_d < dim
    e_ok = offs_e < value_dim
    q, out, grad_out, lse, qd_mask, qe_mask = load_backward_rows(
        Q, OUT, GRAD_OUT, LSE, bh, rows, row_ok, offs_d, offs_e, d_ok, e_ok, length, dim, value_dim)
    grad_lse = tl.load(GRAD_LSE + bh * length + rows, mask=row_ok, other=0.0)
    # rowsum(dO ∘ O) = Σ_slot p (dO · v); the lse gradient g adds p·g to every logit's gradient.
    delta = tl.sum(grad_out * out, axis=1) - grad_lse
    grad_q = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    k_base = K + bh * num_keys * dim
    v_base = V + bh * num_keys * value_dim
    for start in range(0, slots, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        cell_ok = row_ok[:, None] & (cols < slots)[None, :]
        idx = tl.load(IDX + b * si_b + h * si_h + rows[:, None] * si_t + cols[None, :], mask=cell_ok, other=0)
        ok = tl.load(VALID + b * sv_b + h * sv_h + rows[:, None] * sv_t + cols[None, :], mask=cell_ok,
                     other=0) != 0
        ok = ok & cell_ok
        kd_mask = ok[:, :, None] & d_ok[None, None, :]
        ve_mask = ok[:, :, None] & e_ok[None, None, :]
        keys = tl.load(k_base + idx[:, :, None] * dim + offs_d[None, None, :], mask=kd_mask,
                       other=0.0).to(tl.float32)
        values = tl.load(v_base + idx[:, :, None] * value_dim + offs_e[None, None, :], mask=ve_mask,
                         other=0.0).to(tl.float32)
        logits = tl.sum(q[:, None, :] * keys, axis=2) * scale
        weights = tl.where(ok, tl.exp(logits - lse[:, None]), 0.0)
        grad_weights = tl.sum(grad_out[:, None, :] * values, axis=2)
        grad_logits = weights * (grad_weights - delta[:, None]) * scale
        grad_q += tl.sum(grad_logits[:, :, None] * keys, axis=1)
        tl.atomic_add(GRAD_K + bh * num_keys * dim + idx[:, :, None] * dim + offs_d[None, None, :],
                      grad_logits[:, :, None] * q[:, None, :], mask=kd_mask)
        v_rows = GRAD_V + bh * num_keys * value_dim + idx[:, :, None] * value_dim
        tl.atomic_add(v_rows + offs_e[None, None, :], weights[:, :, None] * grad_out[:, None, :],
                      mask=ve_mask)
    tl.store(GRAD_Q + bh * length * dim + rows[:, None] * dim + offs_d[None, :],
             grad_q.to(GRAD_Q.dtype.element_ty), mask=qd_mask)


def _blocks(slots: int, dim: int, value_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_K, BLOCK_D, BLOCK_E). On a GPU the [BLOCK_T, BLOCK_K, d] tile must fit the
    registers of one program; in the interpreter (CPU tensors) every program is a Python call, so
    fewer, larger programs are faster."""
    block_d, block_e = next_power_of_2(dim), next_power_of_2(value_dim)
    if device.type == "cpu":
        return 32, min(64, next_power_of_2(slots)), block_d, block_e
    return 16, min(16, next_power_of_2(slots)), block_d, block_e


def _index_strides(index: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """index (or valid as uint8) with contiguous slots; strides (b, h, t) — h may be 0 when all
    heads share one routing (an expanded view is read in place)."""
    if index.stride(-1) != 1:
        index = index.contiguous()
    return index, (index.stride(0), index.stride(1), index.stride(2))


class _TritonRoutedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, index, valid, scale):
        batch, heads, length, dim = q.shape
        num_keys, slots, value_dim = k.shape[2], index.shape[-1], v.shape[-1]
        index, index_strides = _index_strides(index)
        valid, valid_strides = _index_strides(valid.view(torch.uint8))
        out = q.new_empty(batch, heads, length, value_dim)
        lse = torch.empty(batch, heads, length, dtype=torch.float32, device=q.device)
        block_t, block_k, block_d, block_e = _blocks(slots, dim, value_dim, q.device)
        grid = (triton.cdiv(length, block_t), batch * heads)
        if out.numel() and slots:
            _routed_forward_kernel[grid](
                q, k, v, index, valid, out, lse, heads, length, num_keys, slots, dim, value_dim, scale,
                *index_strides, *valid_strides,
                BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_D=block_d, BLOCK_E=block_e)
        elif out.numel():  # no slots at all: every row is empty
            out.zero_()
            lse.fill_(float("-inf"))
        ctx.save_for_backward(q, k, v, index, valid, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, index, valid, out, lse = ctx.saved_tensors
        batch, heads, length, dim = q.shape
        num_keys, slots, value_dim = k.shape[2], index.shape[-1], v.shape[-1]
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float().contiguous()
        grad_q = torch.zeros_like(q)
        # fp32 accumulators: atomic adds of bf16/fp16 lose the small contributions.
        grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        if out.numel() and slots:
            block_t, block_k, block_d, block_e = _blocks(slots, dim, value_dim, q.device)
            grid = (triton.cdiv(length, block_t), batch * heads)
            _routed_backward_kernel[grid](
                q, k, v, index, valid, out, lse, grad_out, grad_lse, grad_q, grad_k, grad_v,
                heads, length, num_keys, slots, dim, value_dim, ctx.scale,
                index.stride(0), index.stride(1), index.stride(2),
                valid.stride(0), valid.stride(1), valid.stride(2),
                BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_D=block_d, BLOCK_E=block_e)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def triton_routed_attention(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor, *, scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """`routed_attention` by the Triton kernel: (out [B, H, T, e] in q's dtype, lse [B, H, T] fp32,
    differentiable). q [B, H, T, d], k [B, H, S, d], v [B, H, S, e], index (long) / valid (bool)
    [B, H, T, K], which may be expanded views over H."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[:2] != k.shape[:2] \
            or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError("q, k, v must be [B, H, T, d], [B, H, S, d], [B, H, S, e] with matching B, H, S, d; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if index.dtype != torch.long or tuple(index.shape[:3]) != tuple(q.shape[:3]) or index.dim() != 4:
        raise ValueError(f"index must be a long tensor [B, H, T, K] with [B, H, T] = {tuple(q.shape[:3])}; "
                         f"got {index.dtype} {tuple(index.shape)}")
    if valid.dtype != torch.bool or valid.shape != index.shape:
        raise ValueError(f"valid must be a bool tensor shaped like index {tuple(index.shape)}; "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_float(name, tensor)
    check_device(q, k, v, index, valid)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _TritonRoutedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), index, valid, scale)
