"""Which path an op takes: CUDA tensors go to the Triton kernels, CPU tensors stay where they were.

Every op file that has a Triton kernel holds a two-line hook, `if use_triton(q): return <this
module's function>(...)`, placed after its argument checks; the functions here keep the op's
contract (shapes, dtypes, return values), so the caller cannot tell which path ran. `triton` is
imported only when a kernel runs: this module itself imports nothing heavy, so `import routeformer`
works without triton (the ops then run in PyTorch on CUDA too).

- `use_triton(*tensors)`: True when triton is importable and every tensor is on CUDA, or inside
  `force_triton()`; False whenever `ROUTEFORMER_TRITON=0` (read at each call: a switch for
  measuring the PyTorch path on a GPU), for float64 tensors (the kernels compute in fp32) and inside
  `torch.compile`d graphs (see below).
- `force_triton()`: run the Triton kernels on CPU tensors too (through Triton's interpreter: exact
  and slow). This is how the dispatch is tested on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from routeformer.ops.triton import triton_available

_FORCED: ContextVar[bool] = ContextVar("routeformer_triton_forced", default=False)


@contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, ops whose kernels exist run them whatever the device (tests, CPU)."""
    token = _FORCED.set(enabled)
    try:
        yield
    finally:
        _FORCED.reset(token)


def use_triton(*tensors: Tensor) -> bool:
    """Whether the op should run its Triton kernel for these tensors (see the module docstring).
    Inside a graph being compiled the answer is False (the kernels are not registered as custom
    ops yet, and dynamo traces neither ContextVars nor the import check): compiled code keeps the
    PyTorch paths, and a CPU graph is unchanged."""
    if torch.compiler.is_compiling():
        return False
    if not _FORCED.get() and not (tensors and all(t.is_cuda for t in tensors)):
        return False
    if any(t.dtype == torch.float64 for t in tensors):  # the kernels compute fp32/bf16/fp16
        return False
    return os.environ.get("ROUTEFORMER_TRITON", "1") != "0" and triton_available()


def routed_attention(q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor,
                     scale: float) -> tuple[Tensor, Tensor]:
    """`ops.gathered.routed_attention`'s contract: (out, lse in q's dtype, detached as the op's is;
    MiTA, which needs the lse gradient, calls the kernel directly)."""
    from routeformer.ops.triton.gathered import triton_routed_attention

    out, lse = triton_routed_attention(q, k, v, index, valid, scale=scale)
    return out, lse.to(q.dtype).detach()


def route_topk(route_q: Tensor, route_k: Tensor, topk: int, *, causal: bool, key_mask: Tensor | None,
               local_window: int, global_tokens: int) -> tuple[Tensor, Tensor, int]:
    """`ops.topk_routing.route_topk`'s contract: (index, valid, scores computed)."""
    from routeformer.ops.triton.topk_routing import triton_route_topk

    return triton_route_topk(route_q, route_k, topk, causal=causal, key_mask=key_mask,
                             local_window=local_window, global_tokens=global_tokens)


def routed_parts(q: Tensor, expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor,
                 assignment: Tensor, slot_valid: Tensor, scale: float) -> tuple[Tensor, Tensor, int, Tensor]:
    """`ops.mita_experts.routed_parts`'s contract (no packing: `pack` does not apply)."""
    from routeformer.ops.triton.mita import triton_routed_parts

    return triton_routed_parts(q, expert_keys, expert_values, expert_valid, assignment, slot_valid, scale)


def merge_partials(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """`ops.attention_lse.merge_partials`'s contract."""
    from routeformer.ops.triton.lse_merge import triton_merge_partials

    return triton_merge_partials(parts)


def band_rows(q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, horizon: Tensor,
              scale: float | None) -> tuple[Tensor, int]:
    """`ops.routed_rows`' causal, unpadded full and local rows (their contract: (out_rows [B, H, M, e],
    executed FLOPs)): each selected row over the `horizon` [B, M] keys ending at its position (row + 1
    for full attention, min(window, row + 1) for local), no decay; padding slots return zeros.
    Differentiable (the C kernel serves inference only)."""
    from routeformer.ops.triton.band import band_flops, triton_band_attention

    batch, heads, count, dim = q_rows.shape
    horizon = torch.where(valid, horizon, 0)
    per_row = horizon[:, None].expand(batch, heads, count).reshape(batch * heads, count)
    log_decay = torch.zeros(batch * heads, count, dtype=torch.float32, device=q_rows.device)
    out = triton_band_attention(q_rows.reshape(batch * heads, count, dim), k, v, log_decay, per_row,
                                rows, scale=scale)
    return out.view(batch, heads, count, -1), band_flops(per_row, dim, v.shape[-1])


def expanding_final_pass(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                         scale: float, block: int) -> Tensor:
    """The final pass of causal, unpadded expanding attention's band path (ops/expanding.py), in its
    layout: q, k, v [B, H, P, d|e] padded to whole blocks, log_decay and horizon [B·H·P / b, b]
    -> out [B·H·P / b, b, e]. Each query reads the `horizon` keys ending at itself under the
    δ·log_decay prior, with the gradient to log_decay (the learnable α, β)."""
    from routeformer.ops.triton.band import triton_band_attention

    batch, heads, padded, dim = q.shape
    rows = batch * heads
    out = triton_band_attention(q.reshape(rows, padded, dim), k, v, log_decay.reshape(rows, padded),
                                horizon.reshape(rows, padded), scale=scale)
    return out.view(-1, block, v.shape[-1])


def fused_single_route(q: Tensor, landmark: Tensor, landmark_values: Tensor, landmark_ok: Tensor | None,
                       expert_keys: Tensor, expert_values: Tensor, expert_valid: Tensor | None,
                       assignment: Tensor, slot_valid: Tensor, shared: bool,
                       scale: float) -> tuple[Tensor, int, Tensor]:
    """`ops.mita_experts.fused_single_route`'s contract (R = 1, bidirectional: (out, FLOPs, bucket
    counts)) without its per-expert loop of SDPA calls: the routed expert on the gathered kernel, the
    shared expert's E pairs as one dense [N, E] part, the two merged by the lse-merge kernel — the same
    softmax over [shared pairs; routed pairs]."""
    from routeformer.ops.flops import dense_attention_flops
    from routeformer.ops.mita_experts import attend_part
    from routeformer.ops.triton.lse_merge import triton_merge_partials
    from routeformer.ops.triton.mita import triton_routed_parts

    if expert_valid is None:
        expert_valid = torch.ones(expert_keys.shape[:4], dtype=torch.bool, device=q.device)
    out, lse, flops, counts = triton_routed_parts(q, expert_keys, expert_values, expert_valid, assignment,
                                                  slot_valid, scale)
    out, lse = out[:, :, :, 0], lse[:, :, :, 0]
    routed = slot_valid[..., :1].to(out.dtype)  # a query routed nowhere returns zeros, as on CPU
    if not shared:
        return out * routed, flops, counts
    allowed = None if landmark_ok is None else landmark_ok[:, None, None, :]
    shared_part = attend_part(q, landmark, landmark_values, allowed, scale)
    batch, heads, length, dim = q.shape
    flops += batch * heads * dense_attention_flops(length * landmark.shape[2], dim, landmark_values.shape[-1])
    return triton_merge_partials([shared_part, (out, lse)]) * routed, flops, counts
