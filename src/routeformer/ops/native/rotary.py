"""The rotary position embedding by the C kernel (rotary_kernels.c), as an autograd function.

Row m of x [B, H, M, d] is rotated by the angles of table slot p = rows[b, m] (or m itself); the
backward rotates the gradient back (the same kernel with the sine negated).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from routeformer.ops.native import pointer, suffix


def rotate(native: ctypes.CDLL, x: Tensor, cos_half: Tensor, sin_half: Tensor, rows: Tensor | None,
           sign: float) -> Tensor:
    """x [B, H, M, d] (any strides; the last axis is made contiguous if it is not), cos_half and
    sin_half [B, T, d/2] contiguous in x's dtype, rows long [B, M] contiguous or None -> the
    rotated x, contiguous. No autograd."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    batch, heads, count, dim = x.shape
    layout = torch.tensor(x.stride()[:3], dtype=torch.long)
    out = x.new_empty(x.shape)
    getattr(native, f"rotary_{suffix(x.dtype)}")(
        x.data_ptr(), pointer(layout), pointer(cos_half), pointer(sin_half), pointer(rows), batch, heads,
        count, cos_half.shape[1], dim, sign, pointer(out), torch.get_num_threads())
    return out


class NativeRotary(torch.autograd.Function):
    """apply(x, cos_half, sin_half, rows, native) -> rotated x (see `rotate`); differentiable in x."""

    @staticmethod
    def forward(ctx, x: Tensor, cos_half: Tensor, sin_half: Tensor, rows: Tensor | None,
                native: ctypes.CDLL) -> Tensor:
        ctx.save_for_backward(cos_half, sin_half, rows)
        ctx.native = native
        return rotate(native, x, cos_half, sin_half, rows, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        cos_half, sin_half, rows = ctx.saved_tensors
        return rotate(ctx.native, grad_out, cos_half, sin_half, rows, -1.0), None, None, None, None
