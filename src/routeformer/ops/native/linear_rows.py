"""Causal linear attention at selected query rows by the C kernels, as an autograd function.

    out[m] = phi_q[m]ᵀ S_p / (phi_q[m] · z_p + eps),   S_p = Σ_{j <= p} phi_k[j] v[j]ᵀ,   z_p = Σ phi_k[j]

at the key position p = positions[b, m] of each valid slot (invalid slots return zeros). The
features phi = elu + 1 are applied by the caller (ops/routed_rows.py), so autograd differentiates
them; this function is differentiable in phi_q, phi_k and v. See linear_rows_kernels.c.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from routeformer.ops.native import pointer, suffix


def _inner_contiguous(t: Tensor) -> Tensor:
    """t itself when its last axis is contiguous (the kernels take the other strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


class NativeLinearRows(torch.autograd.Function):
    """apply(phi_q [BH, M, d] contiguous, phi_k [B, H, T, d], v [B, H, T, e] (any strides),
    positions long [B, M], valid bool [B, M], eps, native library) -> out [BH, M, e]; positions
    ascending over the valid slots."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, positions: Tensor, valid: Tensor,
                eps: float, native: ctypes.CDLL) -> Tensor:
        rows, queries, dim = phi_q.shape
        phi_k, v = _inner_contiguous(phi_k), _inner_contiguous(v)
        layout = torch.tensor([*phi_k.stride()[:3], *v.stride()[:3]], dtype=torch.long)
        out = phi_q.new_empty(rows, queries, v.shape[-1])
        valid = valid.to(torch.uint8).contiguous()
        getattr(native, f"linear_rows_{suffix(phi_q.dtype)}")(
            pointer(phi_q), phi_k.data_ptr(), v.data_ptr(), pointer(layout), pointer(positions),
            pointer(valid), rows, queries, phi_k.shape[1], phi_k.shape[2], dim, v.shape[-1], eps,
            pointer(out), torch.get_num_threads())
        ctx.save_for_backward(phi_q, phi_k, v, layout, positions, valid, out)
        ctx.eps, ctx.native = eps, native
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        phi_q, phi_k, v, layout, positions, valid, out = ctx.saved_tensors
        rows, queries, dim = phi_q.shape
        value_dim = v.shape[-1]
        grad_phi_q = torch.empty_like(phi_q)
        grad_phi_k = phi_k.new_empty(phi_k.shape)  # contiguous, whatever phi_k's strides
        grad_v = v.new_empty(v.shape)
        scratch = phi_q.new_empty(rows, queries, value_dim + 1)  # g_num and g_den between the sweeps
        getattr(ctx.native, f"linear_rows_backward_{suffix(phi_q.dtype)}")(
            pointer(phi_q), phi_k.data_ptr(), v.data_ptr(), pointer(layout), pointer(positions),
            pointer(valid), pointer(out), pointer(grad_out.contiguous()), rows, queries, phi_k.shape[1],
            phi_k.shape[2], dim, value_dim, ctx.eps, pointer(grad_phi_q), pointer(grad_phi_k),
            pointer(grad_v), pointer(scratch), torch.get_num_threads())
        return grad_phi_q, grad_phi_k, grad_v, None, None, None, None
