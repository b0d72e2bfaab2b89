"""The rotary position embedding by the C kernel (rotary_kernels.c), as a `torch.library` custom op.

Row m of x [B, H, M, d] is rotated by the angles of table slot p = rows[b, m] (or m itself); the
backward rotates the gradient back (the same op with the sine negated). bfloat16/float16 inputs
are computed in float32 and returned in their dtype.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops.native import compute_dtype, declare, kernel, native_op, pointer, suffix

_PTR, _INT = ctypes.c_void_p, ctypes.c_int64
# x, layout, cos_half, sin_half, rows, batch, heads, count, table_length, dim, sign, out, threads
# (rotary_kernels.c; checked against the C prototype by `kernel`)
declare(None, [*[_PTR] * 5, *[_INT] * 5, ctypes.c_double, _PTR, ctypes.c_int], "rotary_f32", "rotary_f64")


@native_op("rotary")
def rotary_op(x: Tensor, cos_half: Tensor, sin_half: Tensor, rows: Tensor | None, sign: float) -> Tensor:
    """x [B, H, M, d] (any strides), cos_half and sin_half [B, T, d/2], rows long [B, M] or None ->
    x rotated by sign·angle, contiguous, in x's dtype."""
    dtype, work = x.dtype, compute_dtype(x.dtype)
    x = x if x.dtype == work and x.stride(-1) == 1 else x.to(work).contiguous()
    cos_half, sin_half = (t.to(work).contiguous() for t in (cos_half, sin_half))
    rows = None if rows is None else rows.contiguous()
    batch, heads, count, dim = x.shape
    layout = torch.tensor(x.stride()[:3], dtype=torch.long)
    out = x.new_empty(x.shape)
    kernel(f"rotary_{suffix(work)}")(
        x.data_ptr(), pointer(layout), pointer(cos_half), pointer(sin_half), pointer(rows), batch, heads,
        count, cos_half.shape[1], dim, sign, pointer(out), torch.get_num_threads())
    return out.to(dtype)


@rotary_op.op.register_fake
def _rotary_fake(x, cos_half, sin_half, rows, sign):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, cos_half, sin_half, rows, sign = inputs
    ctx.save_for_backward(cos_half, sin_half, rows)
    ctx.sign = sign


def _backward(ctx, grad_out):
    cos_half, sin_half, rows = ctx.saved_tensors
    return rotary_op.op(grad_out, cos_half, sin_half, rows, -ctx.sign), None, None, None, None


rotary_op.op.register_autograd(_backward, setup_context=_setup)


class NativeRotary:
    """apply(x, cos_half, sin_half, rows, native handle) -> rotated x (see `rotary_op`);
    differentiable in x."""

    @staticmethod
    def apply(x: Tensor, cos_half: Tensor, sin_half: Tensor, rows: Tensor | None, native) -> Tensor:
        return rotary_op(x, cos_half, sin_half, rows, 1.0)
