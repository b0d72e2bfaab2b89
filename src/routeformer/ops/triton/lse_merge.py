"""Triton kernel: the log-sum-exp merge of partial attention results (`merge_partials`).

Axes: P parts, N rows (every leading axis flattened), e value dim.
Attention split over disjoint key sets (MiTA's shared expert, routed experts and own causal block)
is recombined exactly by the online-softmax rule, `routeformer.ops.attention_lse.merge_partials`
being the reference twin:

    w_p = softmax_p(lse_p),   out = Σ_p w_p out_p
    d out_p = w_p g,          d lse_p = w_p (g · out_p − g · out)

with g the gradient of out. The lse gradient is what lets a part's keys learn from the others'
(the weights depend on every lse). One program merges BLOCK_N rows, looping over the parts; the
arithmetic is fp32 whatever the input dtype. A row whose every lse is -inf (no key anywhere)
merges to zeros rather than NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from routeformer.ops.triton._common import check_device, check_float, kernel, next_power_of_2


@kernel
def _merge_forward_kernel(OUTS, LSES, MERGED, parts, rows, value_dim,
                          BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    n_ok = offs_n < rows
    cell = n_ok[:, None] & (offs_e < value_dim)[None, :]
    top = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for part in range(0, parts):
        top = tl.maximum(top, tl.load(LSES + part * rows + offs_n, mask=n_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    for part in range(0, parts):
        weight = tl.exp(tl.load(LSES + part * rows + offs_n, mask=n_ok, other=float("-inf")) - top)
        values = tl.load(OUTS + part * rows * value_dim + offs_n[:, None] * value_dim + offs_e[None, :],
                         mask=cell, other=0.0).to(tl.float32)
        total += weight
        acc += weight[:, None] * values
    merged = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(MERGED + offs_n[:, None] * value_dim + offs_e[None, :], merged.to(MERGED.dtype.element_ty),
             mask=cell)


@kernel
def _merge_backward_kernel(OUTS, LSES, MERGED, GRAD, GRAD_OUTS, GRAD_LSES, parts, rows, value_dim,
                           BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    n_ok = offs_n < rows
    cell = n_ok[:, None] & (offs_e < value_dim)[None, :]
    row_offsets = offs_n[:, None] * value_dim + offs_e[None, :]
    grad = tl.load(GRAD + row_offsets, mask=cell, other=0.0).to(tl.float32)
    merged = tl.load(MERGED + row_offsets, mask=cell, other=0.0).to(tl.float32)
    grad_dot_merged = tl.sum(grad * merged, axis=1)
    top = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for part in range(0, parts):
        top = tl.maximum(top, tl.load(LSES + part * rows + offs_n, mask=n_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_N], tl.float32)
    for part in range(0, parts):
        total += tl.exp(tl.load(LSES + part * rows + offs_n, mask=n_ok, other=float("-inf")) - top)
    total = tl.where(total > 0.0, total, 1.0)
    for part in range(0, parts):
        weight = tl.exp(tl.load(LSES + part * rows + offs_n, mask=n_ok, other=float("-inf")) - top) / total
        values = tl.load(OUTS + part * rows * value_dim + row_offsets, mask=cell, other=0.0).to(tl.float32)
        tl.store(GRAD_OUTS + part * rows * value_dim + row_offsets,
                 (weight[:, None] * grad).to(GRAD_OUTS.dtype.element_ty), mask=cell)
        tl.store(GRAD_LSES + part * rows + offs_n, weight * (tl.sum(grad * values, axis=1) - grad_dot_merged),
                 mask=n_ok)


def _blocks(value_dim: int, device: torch.device) -> tuple[int, int]:
    return (128 if device.type == "cpu" else 32), next_power_of_2(value_dim)


class _TritonMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, outs, lses):
        parts, rows, value_dim = outs.shape
        merged = outs.new_empty(rows, value_dim)
        block_n, block_e = _blocks(value_dim, outs.device)
        if merged.numel():
            _merge_forward_kernel[(triton.cdiv(rows, block_n),)](
                outs, lses, merged, parts, rows, value_dim, BLOCK_N=block_n, BLOCK_E=block_e)
        ctx.save_for_backward(outs, lses, merged)
        return merged

    @staticmethod
    def backward(ctx, grad):
        outs, lses, merged = ctx.saved_tensors
        parts, rows, value_dim = outs.shape
        grad_outs, grad_lses = torch.empty_like(outs), torch.empty_like(lses)
        block_n, block_e = _blocks(value_dim, outs.device)
        if merged.numel():
            _merge_backward_kernel[(triton.cdiv(rows, block_n),)](
                outs, lses, merged, grad.contiguous(), grad_outs, grad_lses, parts, rows, value_dim,
                BLOCK_N=block_n, BLOCK_E=block_e)
        return grad_outs, grad_lses


def triton_merge_partials(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """`merge_partials` by the Triton kernel: parts are (out [..., e], lse [...]) over disjoint key
    sets, all of one shape; returns the merged out [..., e] in the parts' dtype."""
    if not parts:
        raise ValueError("parts must hold at least one (out, lse) pair; got none")
    shape = parts[0][0].shape
    for position, (out, lse) in enumerate(parts):
        if out.shape != shape or lse.shape != shape[:-1] or out.dtype != parts[0][0].dtype:
            raise ValueError(f"parts[{position}] must be (out {tuple(shape)}, lse {tuple(shape[:-1])}) in "
                             f"{parts[0][0].dtype}; got {out.dtype} {tuple(out.shape)}, {tuple(lse.shape)}")
        check_float(f"parts[{position}] out", out)
    check_device(*(t for pair in parts for t in pair))
    outs = torch.stack([out.reshape(-1, shape[-1]) for out, _ in parts])
    lses = torch.stack([lse.reshape(-1).float() for _, lse in parts])
    return _TritonMerge.apply(outs, lses).view(shape)
