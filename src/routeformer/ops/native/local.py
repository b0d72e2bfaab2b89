"""Sliding-window attention in C (local_kernels.c) as `torch.library` custom ops.

Axes: B batch, H heads, T length, d head dim.

`local_attend_op(q, k, v, valid, before, after, scale)` -> (out [B, H, T, d], lse float32 [B, H, T]):
query i reads the keys j with i − before <= j <= i + after inside [0, T) whose `valid` [B, T] entry is
True (None: every key), softmax-weighted; a row with no key returns zeros (lse = +inf). It is
differentiable in q, k and v through `local_attend_backward_op`, which recomputes the scores from
the saved log-sum-exp (FlashAttention's backward). float32 and bfloat16 are computed in place
(bf16 storage, float32 arithmetic); the caller converts other dtypes. The PyTorch twin and fallback
is `routeformer.ops.local.local_attention`.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from routeformer.ops._compile_marks import assume_constant_result
from routeformer.ops.native import declare, kernel, native_op, pointer

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
# The C boundary (local_kernels.c, local_backward_kernels.c), checked against the C prototypes by
# `kernel`: q, k, v, valid, batch, heads, length, dim, before, after, scale, bf16, out, lse, threads
declare(None, [*[_PTR] * 4, *[_INT] * 6, ctypes.c_double, ctypes.c_int, _PTR, _PTR, ctypes.c_int],
        "local_attend")
# q, k, v, valid, out, lse, grad_out, (the 6 sizes), scale, bf16, grad_q, grad_k, grad_v, threads
declare(None, [*[_PTR] * 7, *[_INT] * 6, ctypes.c_double, ctypes.c_int, *[_PTR] * 3, ctypes.c_int],
        "local_attend_backward")
declare(ctypes.c_int, [], "local_attend_available", "local_pairs_available")


@cache
def _functions() -> tuple:
    return kernel("local_attend"), kernel("local_attend_backward")


@assume_constant_result
def local_kernel_available() -> bool:
    """Whether the library was built with the kernel (every instruction-set level builds it:
    AVX-512, AVX2 + FMA and plain C; a library without it would leave the PyTorch path). Asked only
    after `native_kernels` said yes; under torch.compile its answer is baked in (dynamo does not
    trace ctypes)."""
    return _built_with_kernel()


@cache
def _built_with_kernel() -> bool:
    return bool(kernel("local_attend_available")())


def _bytes(valid: Tensor | None) -> Tensor | None:
    return None if valid is None else valid.to(torch.uint8).contiguous()


@native_op("local_attend")
def local_attend_op(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, before: int, after: int,
                    scale: float) -> tuple[Tensor, Tensor]:
    """See the module docstring; q, k, v of one dtype in NATIVE_DTYPES."""
    batch, heads, length, dim = q.shape
    q, k, v = (t.contiguous() for t in (q, k, v))
    valid = _bytes(valid)
    out = q.new_empty(q.shape)
    lse = q.new_empty(batch, heads, length, dtype=torch.float32)
    _functions()[0](pointer(q), pointer(k), pointer(v), pointer(valid), batch * heads, heads, length, dim,
                    before, after, scale, int(q.dtype == torch.bfloat16), pointer(out), pointer(lse),
                    torch.get_num_threads())
    return out, lse


@local_attend_op.op.register_fake
def _local_attend_fake(q, k, v, valid, before, after, scale):
    # Contiguous, as the kernel's results (empty_like would copy a non-contiguous q's strides).
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@native_op("local_attend_backward")
def local_attend_backward_op(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None, out: Tensor, lse: Tensor,
                             grad_out: Tensor, before: int, after: int, scale: float
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v) of `local_attend_op`, in q's dtype."""
    batch, heads, length, dim = q.shape
    q, k, v, out, lse = (t.contiguous() for t in (q, k, v, out, lse))
    grad_out = grad_out.to(q.dtype).contiguous()
    valid = _bytes(valid)
    grads = tuple(q.new_empty(q.shape) for _ in range(3))
    _functions()[1](pointer(q), pointer(k), pointer(v), pointer(valid), pointer(out), pointer(grad_out),
                    pointer(lse), batch * heads, heads, length, dim, before, after, scale,
                    int(q.dtype == torch.bfloat16), *map(pointer, grads), torch.get_num_threads())
    return grads


@local_attend_backward_op.op.register_fake
def _local_attend_backward_fake(q, k, v, valid, out, lse, grad_out, before, after, scale):
    return tuple(q.new_empty(q.shape) for _ in range(3))


def _setup(ctx, inputs, output):
    q, k, v, valid, before, after, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, valid, out, lse)
    ctx.options = (before, after, scale)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, valid, out, lse = ctx.saved_tensors
    grads = local_attend_backward_op.op(q, k, v, valid, out, lse, grad_out, *ctx.options)
    return (*grads, None, None, None, None)


local_attend_op.op.register_autograd(_backward, setup_context=_setup)
