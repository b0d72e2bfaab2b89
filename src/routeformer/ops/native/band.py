"""The banded softmax pass of the C kernels as `torch.library` custom ops: `band_attend` (forward,
band_kernels.c) and `NativeBandAttention` (forward and backward, the final pass of causal
expanding attention), plus expanding attention's inference steps (`expanding_infer`).

Per query m of (batch, head) row bh, at key position p (`positions[b, m]`, or m itself):

    out[m] = Σ_{δ < H[m]} softmax_δ(q[m]·k[p − δ]·scale + δ·log_decay[m]) v[p − δ]

over its own horizon H[m] of keys ending at p. With log_decay from the Beta prior and H from the
inference steps it is expanding attention's final pass (ops/expanding/op.py); with log_decay = 0 and
H = min(window, p + 1) it is causal sliding-window attention at selected rows (the local expert
of hard-routed `meta`, ops/routed_rows.py). A query with H = 0 (a padding slot) returns zeros.

Custom ops (with fake implementations) keep the kernels inside torch.compile's graphs.
bfloat16/float16 inputs are computed in float32 and the results returned in the input's dtype.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops.native import compute_dtype, declare, kernel, native_op, pointer, suffix, widened

_PTR, _INT, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
# The C boundary (band_kernels.c, expanding_kernels.c), each signature written once and checked
# against the C prototypes by `kernel`:
# q, k, v, layout, log_decay, horizon, positions, rows, queries, heads, length, dim, value_dim, scale,
# out, threads
declare(None, [*[_PTR] * 7, *[_INT] * 6, _F64, _PTR, _I32], "band_attend_f32", "band_attend_f64")
# q, k, v, log_decay, horizon, out, grad_out, rows, length, dim, value_dim, scale, grad_q, grad_k,
# grad_v, grad_log_decay, threads
declare(None, [*[_PTR] * 7, *[_INT] * 4, _F64, *[_PTR] * 4, _I32],
        "expanding_attend_backward_f32", "expanding_attend_backward_f64")
# q, k, alpha, beta, rows, heads, length, dim, tol, max_iters, scale, horizon, steps, distance_sum,
# counts, threads
declare(None, [*[_PTR] * 4, *[_INT] * 4, _F64, _INT, _F64, *[_PTR] * 4, _I32],
        "expanding_infer_f32", "expanding_infer_f64")


def _band_forward(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                  positions: Tensor | None, scale: float) -> Tensor:
    """The kernel call: q [BH, M, d], k [B, H, T, d], v [B, H, T, e] (any strides) -> out [BH, M, e]
    in the compute dtype."""
    rows, queries, dim = q.shape
    work = compute_dtype(q.dtype)
    q, log_decay = widened(q).contiguous(), log_decay.to(work).contiguous()
    k, v = (t if t.dtype == work and t.stride(-1) == 1 else t.to(work).contiguous() for t in (k, v))
    horizon = horizon.contiguous()
    positions = None if positions is None else positions.contiguous()
    layout = torch.tensor([*k.stride()[:3], *v.stride()[:3]], dtype=torch.long)
    out = q.new_empty(rows, queries, v.shape[-1])
    kernel(f"band_attend_{suffix(work)}")(
        pointer(q), k.data_ptr(), v.data_ptr(), pointer(layout), pointer(log_decay), pointer(horizon),
        pointer(positions), rows, queries, k.shape[1], k.shape[2], dim, v.shape[-1], scale, pointer(out),
        torch.get_num_threads())
    return out


@native_op("band_attend")
def band_attend_op(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                   positions: Tensor | None, scale: float) -> Tensor:
    """The banded pass (no autograd): see the module docstring; out [BH, M, e] in q's dtype."""
    return _band_forward(q, k, v, log_decay, horizon, positions, scale).to(q.dtype)


@band_attend_op.op.register_fake
def _band_attend_fake(q, k, v, log_decay, horizon, positions, scale):
    return q.new_empty(*q.shape[:2], v.shape[-1])


def band_attend(native, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                positions: Tensor | None, scale: float) -> Tensor:
    """q [BH, M, d], log_decay [BH, M], horizon long [BH, M], positions long [B, M] or None (query m
    at position m); k [B, H, T, d] and v [B, H, T, e] with any strides -> out [BH, M, e]. Not
    differentiable: for inference (`native`, the handle of `native_kernels`, says the kernels
    serve these tensors)."""
    return band_attend_op(q, k, v, log_decay, horizon, positions, scale)


# -- the final pass of expanding attention, with its backward ---------------------------------------
@native_op("band_attention")
def band_attention_op(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                      scale: float) -> Tensor:
    """q, k [BH, T, d], v [BH, T, e], log_decay [BH, T], horizon long [BH, T]; query i at position i
    -> out [BH, T, e] in q's dtype; differentiable in q, k, v and log_decay."""
    return _band_forward(q, k[None], v[None], log_decay, horizon, None, scale).to(q.dtype)


@band_attention_op.op.register_fake
def _band_attention_fake(q, k, v, log_decay, horizon, scale):
    return q.new_empty(*q.shape[:2], v.shape[-1])


@native_op("band_attention_backward")
def band_attention_backward_op(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                               out: Tensor, grad_out: Tensor, scale: float
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v, grad_log_decay), each in its input's dtype (per query,
    expanding_kernels.c)."""
    rows, length, dim = q.shape
    dtypes = (q.dtype, k.dtype, v.dtype, log_decay.dtype)
    work = compute_dtype(q.dtype)
    q, k, v, log_decay, out, grad_out = (t.to(work).contiguous() for t in (q, k, v, log_decay, out, grad_out))
    grad_q, grad_log_decay = torch.empty_like(q), torch.empty_like(log_decay)
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    horizon = horizon.contiguous()  # a name: a temporary would be freed before the call reads it
    kernel(f"expanding_attend_backward_{suffix(work)}")(
        pointer(q), pointer(k), pointer(v), pointer(log_decay), pointer(horizon), pointer(out),
        pointer(grad_out), rows, length, dim, v.shape[-1], scale, pointer(grad_q), pointer(grad_k),
        pointer(grad_v), pointer(grad_log_decay), torch.get_num_threads())
    grads = (grad_q, grad_k, grad_v, grad_log_decay)
    return tuple(grad.to(dtype) for dtype, grad in zip(dtypes, grads, strict=True))


@band_attention_backward_op.op.register_fake
def _band_attention_backward_fake(q, k, v, log_decay, horizon, out, grad_out, scale):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, log_decay))


def _band_attention_setup(ctx, inputs, output):
    q, k, v, log_decay, horizon, scale = inputs
    ctx.save_for_backward(q, k, v, log_decay, horizon, output)
    ctx.scale = scale


def _band_attention_backward(ctx, grad_out):
    q, k, v, log_decay, horizon, out = ctx.saved_tensors
    grads = band_attention_backward_op.op(q, k, v, log_decay, horizon, out, grad_out, ctx.scale)
    return (*grads, None, None)


band_attention_op.op.register_autograd(_band_attention_backward, setup_context=_band_attention_setup)


class NativeBandAttention:
    """apply(q, k, v [BH, T, ·], log_decay [BH, T], horizon long [BH, T], scale, native) -> out
    [BH, T, e], query i at position i; differentiable in q, k, v and log_decay. The forward is
    query-blocked (band_kernels.c); the backward runs one query at a time (expanding_kernels.c)."""

    @staticmethod
    def apply(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor, scale: float,
              native) -> Tensor:
        return band_attention_op(q, k, v, log_decay, horizon, scale)


# -- expanding attention's inference steps -----------------------------------------------------------
@native_op("expanding_infer")
def expanding_infer_op(q: Tensor, k: Tensor, alpha: Tensor, beta: Tensor, heads: int, tol: float,
                       max_iters: int, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query of q, k [BH, T, d] with the Beta prior alpha, beta [H]: (horizon long [BH, T],
    steps long [BH, T], the expected distances' sum [BH, T] in the compute dtype, counts long [2]:
    the q·k products and the softmax entries the steps computed). No gradient."""
    rows, length, dim = q.shape
    work = compute_dtype(q.dtype)
    q, k, alpha, beta = (t.detach().to(work).contiguous() for t in (q, k, alpha, beta))
    horizon = torch.empty(rows, length, dtype=torch.long)
    steps = torch.empty_like(horizon)
    distance_sum = q.new_empty(rows, length)
    counts = torch.zeros(2, dtype=torch.long)
    kernel(f"expanding_infer_{suffix(work)}")(
        pointer(q), pointer(k), pointer(alpha), pointer(beta), rows, heads, length, dim, float(tol),
        max_iters, scale, pointer(horizon), pointer(steps), pointer(distance_sum), pointer(counts),
        torch.get_num_threads())
    return horizon, steps, distance_sum, counts


@expanding_infer_op.op.register_fake
def _expanding_infer_fake(q, k, alpha, beta, heads, tol, max_iters, scale):
    shape = q.shape[:2]
    return (q.new_empty(shape, dtype=torch.long), q.new_empty(shape, dtype=torch.long),
            q.new_empty(shape, dtype=compute_dtype(q.dtype)), q.new_empty(2, dtype=torch.long))
