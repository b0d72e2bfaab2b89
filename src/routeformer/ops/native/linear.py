"""Causal linear attention by the C kernels (linear_kernels.c), as `torch.library` custom ops.

`routeformer::causal_linear` computes `linear_attention(q, k, v, mask=mask, causal=True, eps=eps)`
from the raw q, k, v (the feature map phi = elu + 1 is applied inside the kernel) and returns the
output, its per-row denominators (fp32 [B, H, T], eps included) and, when `save_states`, the
running state before each chunk (fp32 [B, H, T/BLOCK, e16 + 1, d16]; else empty). The last two are
for the backward and not differentiable. `routeformer::causal_linear_backward` is its registered
backward: one sweep from the last chunk to the first that recomputes each chunk's scores instead of
saving them, so memory stays O(T·(d + e) + (T/BLOCK)·d·e).

Storage float32 or bfloat16 (the kernels accumulate in float32 either way; for bfloat16 the d×e
state products multiply bf16 operands where the CPU has AVX-512 BF16); q, k, v may have any
batch/head/token strides with a contiguous last axis. Other dtypes use the PyTorch path
(`supported` says which).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops.native import declare, kernel, native_op, pointer

# Tokens per chunk of the kernels' sweeps (a multiple of 16: the chunk blocks are padded to 16
# columns). 64 was fastest or tied among 32, 48, 64, 96, 128 at T = 16384, d = e = 64, fp32 and bf16
# (loaded 2-core machine, alternating in one process).
BLOCK = 64
STORAGE = (torch.float32, torch.bfloat16)
_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
# The C boundary (linear_kernels.c), checked against the C prototypes by `kernel`:
# q, k, v, layout, keep, batch, heads, length, dim, value_dim, block, eps, bf16, out, den, states,
# threads -> 0, or an error code (see _check)
declare(_INT, [_PTR] * 5 + [_INT] * 6 + [ctypes.c_double, ctypes.c_int, *[_PTR] * 3, ctypes.c_int],
        "causal_linear_forward")
# q, k, v, layout, keep, out, den, states, grad_out, batch, heads, length, dim, value_dim, block, bf16,
# dq, dk, dv, threads
declare(_INT, [_PTR] * 9 + [_INT] * 6 + [ctypes.c_int, _PTR, _PTR, _PTR, ctypes.c_int],
        "causal_linear_backward")


def supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernels take these tensors (CPU, one storage dtype the kernels read)."""
    return q.dtype in STORAGE and q.dtype == k.dtype == v.dtype and q.device.type == "cpu"


def _inner_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _layout(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.tensor([*q.stride()[:3], *k.stride()[:3], *v.stride()[:3]], dtype=torch.long)


def _mask_bytes(mask: Tensor | None) -> Tensor | None:
    return None if mask is None else mask.to(torch.uint8).contiguous()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("routeformer: the causal linear kernel could not allocate its chunk scratch")


def _states_shape(q: Tensor, v: Tensor) -> tuple[int, ...]:
    batch, heads, length, dim = q.shape
    return batch, heads, -(-length // BLOCK), _round16(v.shape[-1]) + 1, _round16(dim)


def _round16(size: int) -> int:
    return -(-size // 16) * 16


@native_op("causal_linear")
def causal_linear(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, eps: float,
                  save_states: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q, k [B, H, T, d], v [B, H, T, e] (fp32 or bf16, one dtype), mask bool [B, T] or None ->
    (out [B, H, T, e] in q's dtype, den fp32 [B, H, T], states fp32 (empty unless save_states))."""
    q, k, v = (_inner_contiguous(t) for t in (q, k, v))
    batch, heads, length, dim = q.shape
    out = q.new_empty(batch, heads, length, v.shape[-1])
    den = q.new_empty(batch, heads, length, dtype=torch.float32)
    # Zeroed where d or e leaves padding the kernel does not write (a defined output for opcheck).
    fill = q.new_zeros if dim % 16 or v.shape[-1] % 16 else q.new_empty
    states = fill(_states_shape(q, v) if save_states else (0,), dtype=torch.float32)
    # Bound to names: a temporary's memory would be freed before the call reads it.
    layout, keep = _layout(q, k, v), _mask_bytes(mask)
    function = kernel("causal_linear_forward")
    _check(function(q.data_ptr(), k.data_ptr(), v.data_ptr(), pointer(layout), pointer(keep), batch, heads,
                    length, dim, v.shape[-1], BLOCK, eps, int(q.dtype == torch.bfloat16), pointer(out),
                    pointer(den), pointer(states) if save_states else None, torch.get_num_threads()))
    return out, den, states


@causal_linear.op.register_fake
def _causal_linear_fake(q, k, v, mask, eps, save_states):
    states = q.new_empty(_states_shape(q, v) if save_states else (0,), dtype=torch.float32)
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32), states


@native_op("causal_linear_backward")
def causal_linear_backward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, den: Tensor,
                           states: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous, in q's dtype; out, den and states as `causal_linear` returned them
    (states saved; an empty one is recomputed here by a forward pass)."""
    q, k, v = (_inner_contiguous(t) for t in (q, k, v))
    if states.numel() == 0:
        states = causal_linear.function(q, k, v, mask, 1e-6, True)[2]  # eps does not enter the states
    out, den, states = out.contiguous(), den.contiguous(), states.contiguous()
    grad_out = grad_out.to(q.dtype).contiguous()
    batch, heads, length, dim = q.shape
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    layout, keep = _layout(q, k, v), _mask_bytes(mask)
    function = kernel("causal_linear_backward")
    _check(function(q.data_ptr(), k.data_ptr(), v.data_ptr(), pointer(layout), pointer(keep), pointer(out),
                    pointer(den), pointer(states), pointer(grad_out), batch, heads, length, dim, v.shape[-1],
                    BLOCK, int(q.dtype == torch.bfloat16), pointer(dq), pointer(dk), pointer(dv),
                    torch.get_num_threads()))
    return dq, dk, dv


@causal_linear_backward.op.register_fake
def _causal_linear_backward_fake(q, k, v, mask, out, den, states, grad_out):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, mask, _, _ = inputs
    out, den, states = output
    ctx.mark_non_differentiable(den, states)
    ctx.save_for_backward(q, k, v, mask, out, den, states)


def _backward(ctx, grad_out, _grad_den, _grad_states):
    q, k, v, mask, out, den, states = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    dq, dk, dv = causal_linear_backward.op(q, k, v, mask, out, den, states, grad_out)
    return dq, dk, dv, None, None, None


causal_linear.op.register_autograd(_backward, setup_context=_setup)


def causal_linear_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, eps: float) -> Tensor:
    """The output of `causal_linear` (see the module docstring); the states are saved only when a
    gradient will be wanted. Under torch.compile dynamo reads grad mode and `requires_grad` at
    trace time (and guards on them), so a compiled inference graph saves nothing either."""
    save = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return causal_linear(q, k, v, mask, eps, save)[0]
