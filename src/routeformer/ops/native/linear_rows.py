"""Causal linear attention at selected query rows by the C kernels, as a `torch.library` custom op.

    out[m] = phi_q[m]ᵀ S_p / (phi_q[m] · z_p + eps),   S_p = Σ_{j <= p} phi_k[j] v[j]ᵀ,   z_p = Σ phi_k[j]

at the key position p = positions[b, m] of each valid slot (invalid slots return zeros). The
features phi = elu + 1 are applied by the caller (ops/routed_rows.py), so autograd differentiates
them; the op is differentiable in phi_q, phi_k and v (`routeformer::linear_rows_backward`). See
linear_rows_kernels.c. bfloat16/float16 inputs are computed in float32 and returned in their dtype.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops.native import compute_dtype, declare, kernel, native_op, pointer, suffix

_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
# The C boundary (linear_rows_kernels.c), checked against the C prototypes by `kernel`:
# queries, phi_k (or k), v, layout, positions, valid, rows, queries, heads, length, dim, value_dim, eps,
# out, threads
declare(None, [*[_PTR] * 6, *[_INT] * 6, ctypes.c_double, _PTR, ctypes.c_int],
        "linear_rows_f32", "linear_rows_f64", "linear_rows_features_f32", "linear_rows_features_f64")
# phi_q, phi_k, v, layout, positions, valid, out, grad_out, rows, queries, heads, length, dim,
# value_dim, eps, grad_phi_q, grad_phi_k, grad_v, scratch, threads
declare(None, [*[_PTR] * 8, *[_INT] * 6, ctypes.c_double, *[_PTR] * 4, ctypes.c_int],
        "linear_rows_backward_f32", "linear_rows_backward_f64")


def _inner_contiguous(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t itself when it has `dtype` and a contiguous last axis (the kernels take the other
    strides), else a contiguous copy in `dtype`."""
    return t if t.dtype == dtype and t.stride(-1) == 1 else t.to(dtype).contiguous()


def _layout(phi_k: Tensor, v: Tensor) -> Tensor:
    return torch.tensor([*phi_k.stride()[:3], *v.stride()[:3]], dtype=torch.long)


def _rows_forward(name: str, queries: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor,
                  eps: float) -> Tensor:
    """One call of the forward row kernel `name` (`linear_rows` on features, `linear_rows_features`
    on raw q, k): queries [BH, M, d], k [B, H, T, d], v [B, H, T, e] (any strides) -> out [BH, M, e]
    in the compute dtype."""
    rows, count, dim = queries.shape
    work = compute_dtype(queries.dtype)
    queries = queries.to(work).contiguous()
    k, v = _inner_contiguous(k, work), _inner_contiguous(v, work)
    out = queries.new_empty(rows, count, v.shape[-1])
    # Bound to names: a temporary's memory would be freed before the call reads it.
    valid, positions, layout = valid.to(torch.uint8).contiguous(), positions.contiguous(), _layout(k, v)
    kernel(f"{name}_{suffix(work)}")(
        pointer(queries), k.data_ptr(), v.data_ptr(), pointer(layout), pointer(positions), pointer(valid),
        rows, count, k.shape[1], k.shape[2], dim, v.shape[-1], eps, pointer(out), torch.get_num_threads())
    return out


@native_op("linear_rows")
def linear_rows_op(phi_q: Tensor, phi_k: Tensor, v: Tensor, positions: Tensor, valid: Tensor,
                   eps: float) -> Tensor:
    """phi_q [BH, M, d], phi_k [B, H, T, d], v [B, H, T, e] (any strides), positions long [B, M]
    (ascending over the valid slots), valid bool [B, M] -> out [BH, M, e] in the compute dtype
    (float32 for bfloat16/float16; `NativeLinearRows` returns phi_q's dtype)."""
    return _rows_forward("linear_rows", phi_q, phi_k, v, positions, valid, eps)


@linear_rows_op.op.register_fake
def _linear_rows_fake(phi_q, phi_k, v, positions, valid, eps):
    return phi_q.new_empty(*phi_q.shape[:2], v.shape[-1], dtype=compute_dtype(phi_q.dtype))


@native_op("linear_rows_backward")
def linear_rows_backward_op(phi_q: Tensor, phi_k: Tensor, v: Tensor, positions: Tensor, valid: Tensor,
                            out: Tensor, grad_out: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_phi_q, grad_phi_k, grad_v), contiguous, each in its input's dtype."""
    rows, queries, dim = phi_q.shape
    dtypes = (phi_q.dtype, phi_k.dtype, v.dtype)
    work = compute_dtype(phi_q.dtype)
    phi_q, out, grad_out = (t.to(work).contiguous() for t in (phi_q, out, grad_out))
    phi_k, v = _inner_contiguous(phi_k, work), _inner_contiguous(v, work)
    value_dim = v.shape[-1]
    grad_phi_q = torch.empty_like(phi_q)
    grad_phi_k = phi_k.new_empty(phi_k.shape)  # contiguous, whatever phi_k's strides
    grad_v = v.new_empty(v.shape)
    scratch = phi_q.new_empty(rows, queries, value_dim + 1)  # g_num and g_den between the sweeps
    valid, positions, layout = valid.to(torch.uint8).contiguous(), positions.contiguous(), _layout(phi_k, v)
    kernel(f"linear_rows_backward_{suffix(work)}")(
        pointer(phi_q), phi_k.data_ptr(), v.data_ptr(), pointer(layout), pointer(positions), pointer(valid),
        pointer(out), pointer(grad_out), rows, queries,
        phi_k.shape[1], phi_k.shape[2], dim, value_dim, eps, pointer(grad_phi_q), pointer(grad_phi_k),
        pointer(grad_v), pointer(scratch), torch.get_num_threads())
    grads = (grad_phi_q, grad_phi_k, grad_v)
    return tuple(grad.to(dtype) for dtype, grad in zip(dtypes, grads, strict=True))


@linear_rows_backward_op.op.register_fake
def _linear_rows_backward_fake(phi_q, phi_k, v, positions, valid, out, grad_out, eps):
    return tuple(t.new_empty(t.shape) for t in (phi_q, phi_k, v))


def _setup(ctx, inputs, output):
    phi_q, phi_k, v, positions, valid, eps = inputs
    ctx.save_for_backward(phi_q, phi_k, v, positions, valid, output)
    ctx.eps = eps


def _backward(ctx, grad_out):
    phi_q, phi_k, v, positions, valid, out = ctx.saved_tensors
    grads = linear_rows_backward_op.op(phi_q, phi_k, v, positions, valid, out, grad_out, ctx.eps)
    return (*grads, None, None, None)


linear_rows_op.op.register_autograd(_backward, setup_context=_setup)


class NativeLinearRows:
    """apply(phi_q [BH, M, d] contiguous, phi_k [B, H, T, d], v [B, H, T, e] (any strides),
    positions long [B, M], valid bool [B, M], eps, native handle) -> out [BH, M, e] in phi_q's
    dtype; positions ascending over the valid slots."""

    @staticmethod
    def apply(phi_q: Tensor, phi_k: Tensor, v: Tensor, positions: Tensor, valid: Tensor, eps: float,
              native) -> Tensor:
        return linear_rows_op(phi_q, phi_k, v, positions, valid, eps).to(phi_q.dtype)


def linear_rows_features(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor,
                         eps: float) -> Tensor:
    """Inference only (no autograd): `linear_rows_op` from the raw q [BH, M, d] and k [B, H, T, d]
    (any strides), the kernel applying phi = elu + 1 itself (`linear_rows_features_*`): no
    feature tensors, which in PyTorch cost about twice the sweep on strided head views. Returns
    out [BH, M, e] in q's dtype."""
    return _rows_forward("linear_rows_features", q, k, v, positions, valid, eps).to(q.dtype)
