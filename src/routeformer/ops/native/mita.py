"""Bidirectional MiTA's routed step (R = 1) by the C kernel of native/mita_kernels.c, for inference.

Axes: B batch, H heads, N length, d head dim (e value dim), E experts, K keys per expert.

The kernel computes what `mita_experts.fused_single_route` computes — each query's softmax over
[the shared expert's E pairs; its routed expert's K keys] — in one pass per (batch, head) that reads
the queries in place, visits them expert by expert and writes each output row in place (no sorted
copies of the queries, no per-expert calls, no scatter back). It is forward-only: `single_route`
returns None (the caller runs the PyTorch twin) when a gradient is wanted, when the native kernels
are switched off or unavailable, or for tensors they do not take. fp32/fp64 compute in their own
dtype (the op upcasts bf16/fp16 before it gets here).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from routeformer.ops.backends import NATIVE, mita_inference_backend
from routeformer.ops.native import declare, kernel, pointer, suffix

_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
# The C boundary (native/mita_kernels.c), checked against the C prototypes by `kernel`:
# q, shared_logits, landmark_values, landmark_ok, keys_t, values, key_ok, chosen, groups, length, experts,
# width, dim, value_dim, scale, out, counts, threads
declare(None, [*[_PTR] * 8, *[_INT] * 6, ctypes.c_double, _PTR, _PTR, ctypes.c_int],
        "mita_route_f32", "mita_route_f64")
# block, groups, keys, experts, offset, width, values, index, size, threads
declare(None, [_PTR, *[_INT] * 5, _PTR, _PTR, _PTR, ctypes.c_int],
        "mita_topk_update_f32", "mita_topk_update_f64")
# rows, width, values, index, size
declare(None, [_INT, _INT, _PTR, _PTR, _PTR], "mita_topk_finish_f32", "mita_topk_finish_f64")
# logits, rows, experts, best, index, threads
declare(None, [_PTR, _INT, _INT, _PTR, _PTR, ctypes.c_int], "mita_argmax_f32", "mita_argmax_f64")


def _contiguous_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def single_route(
    q: Tensor, shared_logits: Tensor | None, landmark_values: Tensor, landmark_ok: Tensor | None,
    expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor | None, assignment: Tensor,
    slot_valid: Tensor, scale: float,
) -> tuple[Tensor, Tensor] | None:
    """(out [B, H, N, e], per-bucket query counts [B·H·E]) or None where the kernel does not apply.

    q [B, H, N, d]; shared_logits [B, H, N, E] (the scaled routing logits; None = no shared
    expert); landmark_values [B, H, E, e]; landmark_ok bool [B, E] (None = every landmark);
    expert_keys / values [B, H, E, K, d|e]; expert_valid bool [B, H, E, K] (None = every key);
    assignment long [B, H, N] (the routed expert) with slot_valid bool [B, H, N] (False: the
    row is zero, as in the PyTorch twin)."""
    tensors = (q, landmark_values, expert_keys, expert_values)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if shared_logits is not None and shared_logits.requires_grad and torch.is_grad_enabled():
        return None
    if q.dtype not in (torch.float32, torch.float64) or any(t.dtype != q.dtype for t in tensors):
        return None
    if mita_inference_backend("mita_routed_step", *tensors)[0] != NATIVE:
        return None
    batch, heads, length, dim = q.shape
    experts, width, value_dim = expert_keys.shape[2], expert_keys.shape[3], expert_values.shape[-1]
    groups = batch * heads
    # Bound to names: a temporary's memory would be freed before the call reads it.
    queries = q.contiguous()
    logits = _contiguous_or_none(shared_logits)
    values_hat = landmark_values.contiguous()
    ok = None if landmark_ok is None else landmark_ok[:, None, :].expand(batch, heads, experts).to(
        torch.uint8).contiguous()
    keys_t = expert_keys.transpose(-1, -2).contiguous()  # [B, H, E, d, K]
    values = expert_values.contiguous()
    key_ok = None if expert_valid is None else expert_valid.to(torch.uint8).contiguous()
    chosen = torch.where(slot_valid, assignment, -1).contiguous()
    out = q.new_empty(batch, heads, length, value_dim)
    counts = torch.empty(groups * experts, dtype=torch.long)
    function = kernel(f"mita_route_{suffix(q.dtype)}")
    function(pointer(queries), pointer(logits), pointer(values_hat), pointer(ok), pointer(keys_t),
             pointer(values), pointer(key_ok), pointer(chosen), groups, length, experts, width, dim,
             value_dim, float(scale), pointer(out), pointer(counts), torch.get_num_threads())
    return out, counts


class StreamingTopK:
    """The top-`width` key indices per landmark, fed one block of transposed scores [B, H, S, E]
    at a time (native/mita_kernels.c: a min-heap per landmark). `make` returns None where the
    kernels cannot serve (the caller keeps the scores and runs torch.topk instead); `indices()`
    gives long [B, H, E, width], ordered as torch.topk orders them (descending score)."""

    def __init__(self, like: Tensor, groups: int, experts: int, width: int) -> None:
        self.groups, self.experts, self.width = groups, experts, width
        self.values = like.new_empty(groups, experts, width)
        self.index = torch.zeros(groups, experts, width, dtype=torch.long)
        self.size = torch.zeros(groups, experts, dtype=torch.long)
        name = suffix(like.dtype)
        self._update = kernel(f"mita_topk_update_{name}")
        self._finish = kernel(f"mita_topk_finish_{name}")

    @classmethod
    def make(cls, like: Tensor, groups: int, experts: int, width: int) -> StreamingTopK | None:
        if mita_inference_backend("mita_streaming_topk", like)[0] != NATIVE:
            return None
        return cls(like, groups, experts, width)

    def update(self, block_t: Tensor, offset: int) -> None:
        """Scores [B, H, S, E] of keys offset .. offset + S − 1 (read before they are overwritten)."""
        block = block_t.detach().contiguous()
        self._update(pointer(block), self.groups, block.shape[-2], self.experts, offset, self.width,
                     pointer(self.values), pointer(self.index), pointer(self.size), torch.get_num_threads())

    def indices(self, shape: tuple[int, ...]) -> Tensor:
        self._finish(self.groups * self.experts, self.width, pointer(self.values), pointer(self.index),
                     pointer(self.size))
        return self.index.view(*shape, self.width)


def route_by_maximum(logits: Tensor) -> tuple[Tensor, Tensor] | None:
    """(values, indices) of the maximum over the last axis of `logits` [..., E] (the first one on
    ties), keepdim, as `logits.max(-1, keepdim=True)`, by one C pass; None where the kernels do not
    apply (a gradient wanted, not CPU fp32/fp64, switched off, compiling)."""
    if logits.requires_grad and torch.is_grad_enabled():
        return None
    if logits.dtype not in (torch.float32, torch.float64) or logits.shape[-1] == 0:
        return None
    if mita_inference_backend("mita_argmax", logits)[0] != NATIVE:
        return None
    flat = logits.contiguous().view(-1, logits.shape[-1])
    best = flat.new_empty(flat.shape[0])
    index = torch.empty(flat.shape[0], dtype=torch.long)
    function = kernel(f"mita_argmax_{suffix(logits.dtype)}")
    function(pointer(flat), flat.shape[0], flat.shape[1], pointer(best), pointer(index),
             torch.get_num_threads())
    shape = (*logits.shape[:-1], 1)
    return best.view(shape), index.view(shape)
