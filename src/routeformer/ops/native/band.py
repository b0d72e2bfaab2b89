"""The banded softmax pass of the C kernels: `band_attend` (forward, band_kernels.c) and
`NativeBandAttention` (forward and backward, the final pass of causal expanding attention).

Per query m of (batch, head) row bh, at key position p (`positions[b, m]`, or m itself):

    out[m] = Σ_{δ < H[m]} softmax_δ(q[m]·k[p − δ]·scale + δ·log_decay[m]) v[p − δ]

over its own horizon H[m] of keys ending at p. With log_decay from the Beta prior and H from the
inference steps it is expanding attention's final pass (ops/expanding.py); with log_decay = 0 and
H = min(window, p + 1) it is causal sliding-window attention at selected rows (the local expert
of hard-routed `meta`, ops/routed_rows.py). A query with H = 0 (a padding slot) returns zeros.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from routeformer.ops.native import pointer, suffix


def band_attend(native: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                positions: Tensor | None, scale: float) -> Tensor:
    """q [BH, M, d], log_decay [BH, M], horizon long [BH, M], positions long [B, M] or None (query m
    at position m), all contiguous; k [B, H, T, d] and v [B, H, T, e] with any strides (their last
    axis is made contiguous if it is not) -> out [BH, M, e]. No autograd: the caller detaches or
    wraps it."""
    rows, queries, dim = q.shape
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    layout = torch.tensor([*k.stride()[:3], *v.stride()[:3]], dtype=torch.long)
    out = q.new_empty(rows, queries, v.shape[-1])
    getattr(native, f"band_attend_{suffix(q.dtype)}")(
        pointer(q), k.data_ptr(), v.data_ptr(), pointer(layout), pointer(log_decay), pointer(horizon),
        pointer(positions), rows, queries, k.shape[1], k.shape[2], dim, v.shape[-1], scale, pointer(out),
        torch.get_num_threads())
    return out


class NativeBandAttention(torch.autograd.Function):
    """apply(q, k, v [BH, T, ·], log_decay [BH, T], horizon long [BH, T], scale, native) -> out
    [BH, T, e], query i at position i; differentiable in q, k, v and log_decay. The forward is
    query-blocked (band_kernels.c); the backward runs one query at a time (expanding_kernels.c)."""

    @staticmethod
    def forward(ctx, q, k, v, log_decay, horizon, scale, native):
        out = band_attend(native, q, k[None], v[None], log_decay, horizon, None, scale)
        ctx.save_for_backward(q, k, v, log_decay, horizon, out)
        ctx.scale, ctx.native = scale, native
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, log_decay, horizon, out = ctx.saved_tensors
        rows, length, dim = q.shape
        grad_out = grad_out.contiguous()
        grad_q, grad_log_decay = torch.empty_like(q), torch.empty_like(log_decay)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        getattr(ctx.native, f"expanding_attend_backward_{suffix(q.dtype)}")(
            pointer(q), pointer(k), pointer(v), pointer(log_decay), pointer(horizon), pointer(out),
            pointer(grad_out), rows, length, dim, v.shape[-1], ctx.scale, pointer(grad_q),
            pointer(grad_k), pointer(grad_v), pointer(grad_log_decay), torch.get_num_threads())
        return grad_q, grad_k, grad_v, grad_log_decay, None, None, None
