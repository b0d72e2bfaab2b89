"""Causal MiTA's query side for training by the C kernels of native/mita_train_kernels.c.

Axes: B batch, H heads, N length, d head dim (e value dim), E landmarks (= experts), K keys per
expert, b block length, M landmark window.

`causal_query_side` computes, for every query of an unpadded causal input, one softmax over its
own block's earlier keys, the shared expert's window of landmarks and its routed expert's K keys
(what ops/mita/op.py's `_causal` computes as three partial softmaxes merged by their log-sum-exps),
forward and backward, each in one pass per (batch, head) group. It is a `torch.library` custom op
(`routeformer::mita_causal_query_side`) with registered autograd: gradients flow to q, k, v, the
landmarks, their values and the gathered expert keys and values (the PyTorch graph around it
carries them back through the landmark stage and the gather). float32/float64 compute in their
own dtype (the op upcasts bf16/fp16 before it gets here).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops.native import declare, kernel, native_op, pointer, suffix

_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
# q, k_t, v, landmark_t, landmark_values, expert_keys_t, expert_values, key_ok, assignment,
# groups, length, experts, width, dim, value_dim, block, window, shared, scale, out, lse, threads
declare(None, [*[_PTR] * 9, *[_INT] * 9, ctypes.c_double, _PTR, _PTR, ctypes.c_int],
        "mita_causal_forward_f32", "mita_causal_forward_f64")
# q, k, k_t, v_t, landmark, landmark_t, landmark_values_t, expert_keys, expert_keys_t, expert_values_t,
# key_ok, assignment, out, lse, grad_out, groups, length, experts, width, dim, value_dim, block,
# window, shared, scale, grad_q, grad_k, grad_v, grad_landmark, grad_landmark_values,
# grad_expert_keys, grad_expert_values, threads
declare(None, [*[_PTR] * 15, *[_INT] * 9, ctypes.c_double, *[_PTR] * 7, ctypes.c_int],
        "mita_causal_backward_f32", "mita_causal_backward_f64")


_LANES = 16  # MT_LANES of mita_train_kernels.c: spare (zero) columns after each transposed row


def _t(x: Tensor) -> Tensor:
    """[..., L, c] -> [..., c, L + 16], contiguous and zero-padded: the kernels' transposed layout
    (they score keys a whole 16-lane vector at a time)."""
    out = x.new_empty(*x.shape[:-2], x.shape[-1], x.shape[-2] + _LANES)
    out[..., :x.shape[-2]] = x.transpose(-1, -2)
    out[..., x.shape[-2]:] = 0
    return out


def _sizes(q: Tensor, landmark: Tensor, expert_keys: Tensor, v: Tensor) -> tuple[int, ...]:
    batch, heads, length, dim = q.shape
    return batch * heads, length, landmark.shape[2], expert_keys.shape[3], dim, v.shape[-1]


@native_op("mita_causal_query_side")
def mita_causal_query_side(
    q: Tensor, k: Tensor, v: Tensor, landmark: Tensor, landmark_values: Tensor, expert_keys: Tensor,
    expert_values: Tensor, key_ok: Tensor | None, assignment: Tensor, block: int, window: int,
    shared: bool, scale: float,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, N, e], lse [B, H, N]) of each query's softmax over its own block's keys ≤ it,
    the landmarks of blocks c − window .. c − 1 (if `shared`) and expert assignment[b, h, n]'s keys
    (none where it is < 0). q, k [B, H, N, d]; v [B, H, N, e]; landmark [B, H, E, d];
    landmark_values [B, H, E, e]; expert_keys / values [B, H, E, K, d|e]; key_ok uint8 [B, H, E, K]
    or None; assignment long [B, H, N]. The input must be unpadded."""
    groups, length, experts, width, dim, value_dim = _sizes(q, landmark, expert_keys, v)
    out = q.new_empty(*q.shape[:3], value_dim)
    lse = q.new_empty(q.shape[:3])
    # Bound to names: a temporary's memory would be freed before the call reads it.
    queries, keys_t, values = q.contiguous(), _t(k), v.contiguous()
    landmark_t, values_hat = _t(landmark), landmark_values.contiguous()
    expert_keys_t, expert_rows = _t(expert_keys), expert_values.contiguous()
    ok = None if key_ok is None else key_ok.contiguous()
    chosen = assignment.contiguous()
    kernel(f"mita_causal_forward_{suffix(q.dtype)}")(
        pointer(queries), pointer(keys_t), pointer(values), pointer(landmark_t), pointer(values_hat),
        pointer(expert_keys_t), pointer(expert_rows), pointer(ok), pointer(chosen), groups, length, experts,
        width, dim, value_dim, block, window, int(shared), float(scale), pointer(out), pointer(lse),
        torch.get_num_threads())
    return out, lse


@mita_causal_query_side.op.register_fake
def _forward_fake(q, k, v, landmark, landmark_values, expert_keys, expert_values, key_ok, assignment, block,
                  window, shared, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3])


@native_op("mita_causal_query_side_backward")
def mita_causal_query_side_backward(
    q: Tensor, k: Tensor, v: Tensor, landmark: Tensor, landmark_values: Tensor, expert_keys: Tensor,
    expert_values: Tensor, key_ok: Tensor | None, assignment: Tensor, out: Tensor, lse: Tensor,
    grad_out: Tensor, block: int, window: int, shared: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `mita_causal_query_side`'s out with respect to q, k, v, landmark,
    landmark_values, expert_keys, expert_values (the weights recomputed from the saved lse)."""
    groups, length, experts, width, dim, value_dim = _sizes(q, landmark, expert_keys, v)
    queries, keys, keys_t, values_t = q.contiguous(), k.contiguous(), _t(k), _t(v)
    landmarks, landmark_t, values_hat_t = landmark.contiguous(), _t(landmark), _t(landmark_values)
    expert_rows, expert_keys_t, expert_values_t = expert_keys.contiguous(), _t(expert_keys), _t(expert_values)
    ok = None if key_ok is None else key_ok.contiguous()
    chosen, output, lses, gradient = assignment.contiguous(), out.contiguous(), lse.contiguous(), \
        grad_out.contiguous()
    grads = [torch.zeros(t.shape, dtype=q.dtype) for t in
             (q, k, v, landmark, landmark_values, expert_keys, expert_values)]
    kernel(f"mita_causal_backward_{suffix(q.dtype)}")(
        pointer(queries), pointer(keys), pointer(keys_t), pointer(values_t), pointer(landmarks),
        pointer(landmark_t), pointer(values_hat_t), pointer(expert_rows), pointer(expert_keys_t),
        pointer(expert_values_t), pointer(ok), pointer(chosen), pointer(output), pointer(lses),
        pointer(gradient), groups, length, experts, width, dim, value_dim, block, window, int(shared),
        float(scale), *(pointer(g) for g in grads), torch.get_num_threads())
    return tuple(grads)


@mita_causal_query_side_backward.op.register_fake
def _backward_fake(q, k, v, landmark, landmark_values, expert_keys, expert_values, key_ok, assignment, out,
                   lse, grad_out, block, window, shared, scale):
    inputs = (q, k, v, landmark, landmark_values, expert_keys, expert_values)
    return tuple(t.new_empty(t.shape) for t in inputs)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9], *output)
    ctx.options = inputs[9:]


def _backward(ctx, grad_out, _grad_lse):
    saved = ctx.saved_tensors
    grads = mita_causal_query_side_backward.op(*saved[:9], saved[9], saved[10], grad_out, *ctx.options)
    return (*grads, None, None, None, None, None, None)


mita_causal_query_side.op.register_autograd(_backward, setup_context=_setup)
