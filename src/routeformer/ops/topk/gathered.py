"""Attention over a per-query set of gathered keys (the exact half of top-k routing).

Axes: B batch, H heads, T queries, S keys, K slots per query, d key dim, e value dim.
`index` [B, H, T, K] names, for every query, the K keys it reads; `valid` [B, H, T, K] says which
slots are real (a query with fewer eligible keys than K has invalid slots). The valid entries of a
row must be distinct keys. A row with no valid slot returns zeros.

Fast paths work on blocks of queries: the keys of one block are gathered once with
`index_select` (B·H·block·K rows), used, and dropped, so memory stays O(T·K + block·K·d). The
backward pass regathers instead of storing the gathered keys (FlashAttention-style recompute) and
scatters key/value gradients back with `index_add_`. The references (ops/topk/reference.py) build
the dense [T, S] mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops.backends import NATIVE, TRITON, routed_attention_backend
from routeformer.ops.grouped_heads import group_queries, query_group, ungroup_queries
from routeformer.ops.native import compute_dtype
from routeformer.ops.native.topk import reads_bf16, routed_attention_op

DEFAULT_BLOCK = 64  # small blocks keep the gathered keys in cache: measured fastest


def _check_gather_args(q: Tensor, k: Tensor, index: Tensor, valid: Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must be [B, H, T, d] and [B, H, S, d] with matching B, H, d; "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    expected = (*q.shape[:3],)
    if index.dim() != 4 or tuple(index.shape[:3]) != expected or index.dtype != torch.long:
        raise ValueError(f"index must be a long tensor [B, H, T, K] with [B, H, T] = {expected}; "
                         f"got {index.dtype} {tuple(index.shape)}")
    if valid is not None and (valid.shape != index.shape or valid.dtype != torch.bool):
        raise ValueError(f"valid must be a bool tensor shaped like index {tuple(index.shape)}; "
                         f"got {valid.dtype} {tuple(valid.shape)}")


def flat_rows(index: Tensor, num_keys: int) -> Tensor:
    """Row numbers into a [B·H·S, d] view of the keys for every (b, h, t, slot)."""
    batch, heads = index.shape[:2]
    offsets = torch.arange(batch * heads, device=index.device).view(batch, heads, 1, 1) * num_keys
    return (index + offsets).reshape(-1)


def _gather(rows_source: Tensor, rows: Tensor, shape: tuple[int, ...]) -> Tensor:
    return rows_source.index_select(0, rows).view(*shape, rows_source.shape[-1])


class _RoutedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, index, valid, scale, block):
        batch, heads, length, _ = q.shape
        num_keys, slots = k.shape[2], index.shape[-1]
        k_rows = k.reshape(batch * heads * num_keys, -1)
        v_rows = v.reshape(batch * heads * num_keys, -1)
        out = q.new_empty(batch, heads, length, v.shape[-1])
        lse = q.new_empty(batch, heads, length)
        for start in range(0, length, block):
            stop = min(length, start + block)
            shape = (batch, heads, stop - start, slots)
            rows = flat_rows(index[:, :, start:stop], num_keys)
            keys, values = _gather(k_rows, rows, shape), _gather(v_rows, rows, shape)
            logits = torch.einsum("bhtd,bhtkd->bhtk", q[:, :, start:stop], keys) * scale
            logits = logits.masked_fill(~valid[:, :, start:stop], float("-inf"))
            row_max = logits.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            weights = torch.exp(logits - row_max)
            total = weights.sum(dim=-1, keepdim=True)
            out[:, :, start:stop] = torch.einsum("bhtk,bhtke->bhte", weights, values) / total.clamp_min(
                torch.finfo(total.dtype).tiny
            )
            lse[:, :, start:stop] = (row_max + total.log()).squeeze(-1)  # -inf for empty rows
        ctx.save_for_backward(q, k, v, index, valid, out, lse)
        ctx.scale, ctx.block = scale, block
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, index, valid, out, lse = ctx.saved_tensors
        scale, block = ctx.scale, ctx.block
        batch, heads, length, _ = q.shape
        num_keys, slots = k.shape[2], index.shape[-1]
        k_rows = k.reshape(batch * heads * num_keys, -1)
        v_rows = v.reshape(batch * heads * num_keys, -1)
        grad_q = torch.zeros_like(q)
        grad_k_rows = torch.zeros_like(k_rows)
        grad_v_rows = torch.zeros_like(v_rows)
        delta = (grad_out * out).sum(dim=-1)  # rowsum(dO ∘ O) = Σ_k p_k (dO · v_k)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        for start in range(0, length, block):
            stop = min(length, start + block)
            shape = (batch, heads, stop - start, slots)
            rows = flat_rows(index[:, :, start:stop], num_keys)
            keys, values = _gather(k_rows, rows, shape), _gather(v_rows, rows, shape)
            q_block, grad_block = q[:, :, start:stop], grad_out[:, :, start:stop]
            logits = torch.einsum("bhtd,bhtkd->bhtk", q_block, keys) * scale
            weights = torch.exp(logits - safe_lse[:, :, start:stop, None])
            weights = weights.masked_fill(~valid[:, :, start:stop], 0.0)
            grad_values = weights.unsqueeze(-1) * grad_block.unsqueeze(-2)
            grad_v_rows.index_add_(0, rows, grad_values.reshape(-1, v.shape[-1]))
            grad_weights = torch.einsum("bhte,bhtke->bhtk", grad_block, values)
            grad_logits = weights * (grad_weights - delta[:, :, start:stop, None]) * scale
            grad_q[:, :, start:stop] = torch.einsum("bhtk,bhtkd->bhtd", grad_logits, keys)
            grad_keys = grad_logits.unsqueeze(-1) * q_block.unsqueeze(-2)
            grad_k_rows.index_add_(0, rows, grad_keys.reshape(-1, k.shape[-1]))
        return grad_q, grad_k_rows.view_as(k), grad_v_rows.view_as(v), None, None, None, None


def routed_attention(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, valid: Tensor, *, scale: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> tuple[Tensor, Tensor]:
    """softmax over each query's gathered keys: out_i = Σ_{slot} softmax_slot(q_i·k_index · scale) v_index.

    q [B, H, T, d], k [B, G, S, d], v [B, G, S, e], index/valid [B, H, T, K] (index may be an
    expanded view, e.g. one routing shared by all heads). Returns (out [B, H, T, e], lse [B, H, T]),
    lse being the log-sum-exp of each row's logits (-inf for an empty row; not differentiable).
    q and k may have a different last dim from v: callers append routing features to q and k to
    add a score bias to the logits. G < H (grouped-query attention, G dividing H): query head h
    reads K/V head h // (H / G); the rows are independent given their indices, so the group's
    queries run as [B, G, g·T] rows of one call over its K/V head (every backend; q and the indices
    are regrouped, K/V are not copied).
    """
    if q.dim() == 4 and k.dim() == 4 and k.shape[1] != q.shape[1] and index.dim() == 4:
        heads, kv_heads = q.shape[1], k.shape[1]
        query_group(q, k)
        if index.shape[1] != heads or valid.shape[1] != heads:
            raise ValueError(f"index and valid must be [B, H, T, K] with H = {heads} query heads; got "
                             f"{tuple(index.shape)} and {tuple(valid.shape)}")
        out, lse = routed_attention(group_queries(q, kv_heads), k, v, group_queries(index, kv_heads),
                                    group_queries(valid, kv_heads), scale=scale, block=block)
        return ungroup_queries(out, heads), ungroup_queries(lse, heads)
    _check_gather_args(q, k, index, valid)
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must be [B, H, S, e] with k's [B, H, S] = {tuple(k.shape[:3])}; got {tuple(v.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend, _ = routed_attention_backend(q, k, v, index.shape[-1])
    if backend == TRITON:
        from routeformer.ops.triton.gathered import triton_routed_attention  # triton is optional

        # lse in q's dtype, detached as on the other paths (MiTA, which needs the lse gradient,
        # calls the kernel itself).
        out, lse = triton_routed_attention(q, k, v, index, valid, scale=scale)
        return out, lse.to(q.dtype).detach()
    if backend == NATIVE:
        # The fused C kernel as a custom op (compile-safe). bf16 is read as stored (the op's bf16
        # kernels); fp16 is widened here, under autograd, rather than inside the op: the backward
        # then reuses the saved fp32 copies instead of converting q, k, v, out and grad_out again.
        work = q.dtype if reads_bf16(q, k, v) else compute_dtype(q.dtype)
        # contiguous here, so the tensors autograd saves need no second copy in the backward
        out, lse = routed_attention_op(*(t.to(work).contiguous() for t in (q, k, v)), index, valid, scale)
        return out.to(q.dtype), lse.to(q.dtype).detach()
    return _RoutedAttention.apply(q, k.contiguous(), v.contiguous(), index, valid, scale, block)


class _GatheredDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, index, block):
        batch, heads, length, _ = a.shape
        num_keys, slots = b.shape[2], index.shape[-1]
        b_rows = b.reshape(batch * heads * num_keys, -1)
        out = a.new_empty(batch, heads, length, slots)
        for start in range(0, length, block):
            stop = min(length, start + block)
            rows = flat_rows(index[:, :, start:stop], num_keys)
            gathered = _gather(b_rows, rows, (batch, heads, stop - start, slots))
            out[:, :, start:stop] = torch.einsum("bhtd,bhtkd->bhtk", a[:, :, start:stop], gathered)
        ctx.save_for_backward(a, b, index)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, index = ctx.saved_tensors
        batch, heads, length, _ = a.shape
        num_keys, slots = b.shape[2], index.shape[-1]
        b_rows = b.reshape(batch * heads * num_keys, -1)
        grad_a = torch.zeros_like(a)
        grad_b_rows = torch.zeros_like(b_rows)
        for start in range(0, length, ctx.block):
            stop = min(length, start + ctx.block)
            rows = flat_rows(index[:, :, start:stop], num_keys)
            gathered = _gather(b_rows, rows, (batch, heads, stop - start, slots))
            grad_block = grad_out[:, :, start:stop]
            grad_a[:, :, start:stop] = torch.einsum("bhtk,bhtkd->bhtd", grad_block, gathered)
            grad_gathered = grad_block.unsqueeze(-1) * a[:, :, start:stop].unsqueeze(-2)
            grad_b_rows.index_add_(0, rows, grad_gathered.reshape(-1, b.shape[-1]))
        return grad_a, grad_b_rows.view_as(b), None, None


def gathered_dot(a: Tensor, b: Tensor, index: Tensor, *, block: int = DEFAULT_BLOCK) -> Tensor:
    """out[..., t, slot] = a[..., t, :] · b[..., index[..., t, slot], :]; a [B, H, T, r], b [B, H, S, r].

    Used for the routing scores of the selected keys, which the distillation loss and the entropy
    regulariser need with gradients. Blockwise like `routed_attention`; O(T·K) memory.
    """
    _check_gather_args(a, b, index, None)
    return _GatheredDot.apply(a, b.contiguous(), index, block)
