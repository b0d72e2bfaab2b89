"""Softmax attention of selected query rows, a chunk of consecutive rows at a time.

Axes: B batch, H heads, T keys, M selected rows, d head dim (e value dim).

The full and local experts of hard-routed `meta` answer for a subset of the query rows (see
routed_rows.py). Rows are ascending, so `chunk` consecutive rows read one contiguous key range
[lo, hi) — a view of k and v, never a copy — under a bool mask `rule(keys, rows)` (and the key
padding mask). `rows_attention_by_chunks` returns the rows' outputs and the FLOPs it executed.

Fast path (CPU, any dtype): the blocked online softmax of attention_lse.py per chunk (public
PyTorch ops, keys in blocks, fp32 accumulation, O(chunk·block) memory), inside one autograd
function whose backward runs the blocked backward per chunk and adds each chunk's key/value
gradient into one buffer. (Plain autograd over the sliced views would allocate a zero tensor the
size of k and v per chunk for the slices' gradients.) Elsewhere (GPU): SDPA per chunk under
autograd.
Rows with no allowed key (key padding) return zeros and pass no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from routeformer.ops.attention_lse import MASKED, lse_backward, lse_forward
from routeformer.ops.flops import dense_attention_flops
from routeformer.ops.full.op import sdpa_allowed

KeyRange = Callable[[int, int], tuple[int, int]]  # (first row, last row) -> keys [lo, hi)
# (key positions [1, 1, L], row positions [B, rows, 1]) -> bool allowed [B, rows, L]. Broadcast
# comparisons: no [B, rows, L] offset tensor is materialised.
Rule = Callable[[Tensor, Tensor], Tensor]


def filled_positions(rows: Tensor, valid: Tensor) -> Tensor:
    """Padding slots (the tail of a batch row) take the last real row's position, so a chunk's
    key range is set by real rows; their outputs are zeroed by the caller."""
    return rows.masked_fill(~valid, -1).cummax(dim=1).values.clamp_min(0)


def chunk_starts(positions: Tensor, chunk: int, bucket: int | None) -> list[int]:
    """First slot of each chunk: every `chunk` slots, and (with `bucket`) wherever the slots'
    position bucket (position // bucket, by the batch's smallest position) changes."""
    count = positions.shape[1]
    if bucket is None:
        return list(range(0, count, chunk))
    bucket_of = positions.min(dim=0).values // bucket  # ascending along the slots
    slots = torch.arange(count, device=positions.device)
    opens = torch.ones(count, dtype=torch.bool, device=positions.device)
    opens[1:] = bucket_of[1:] != bucket_of[:-1]
    bucket_start = torch.where(opens, slots, 0).cummax(dim=0).values
    return torch.nonzero(opens | ((slots - bucket_start) % chunk == 0)).flatten().tolist()


def blocked_attention_fits(q_rows: Tensor, v: Tensor) -> bool:
    """Whether the chunks run the blocked pass (CPU, any dtype); elsewhere (GPU) SDPA per chunk."""
    return q_rows.device.type == "cpu"


class _ChunkedAttention(torch.autograd.Function):
    """out_rows = concat over chunks of attention(q_rows[start:stop], k[lo:hi], v[lo:hi], bias)."""

    @staticmethod
    def forward(ctx, q_rows, k, v, plan, bias_of, scale):
        outs, lses = [], []
        for index, (start, stop, lo, hi) in enumerate(plan):
            out, lse = lse_forward(q_rows[:, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi], bias_of(index),
                                   False, scale)
            outs.append(out)
            lses.append(lse)
        ctx.save_for_backward(q_rows, k, v)
        ctx.plan, ctx.bias_of, ctx.scale, ctx.outs, ctx.lses = plan, bias_of, scale, outs, lses
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad_out):
        q_rows, k, v = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.empty_like(q_rows), torch.zeros_like(k), torch.zeros_like(v)
        for index, (start, stop, lo, hi) in enumerate(ctx.plan):
            chunk_grads = lse_backward(
                q_rows[:, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi], ctx.bias_of(index), False,
                ctx.scale, ctx.outs[index], ctx.lses[index], grad_out[:, :, start:stop], None)
            grad_q[:, :, start:stop] = chunk_grads[0]
            grad_k[:, :, lo:hi] += chunk_grads[1]
            grad_v[:, :, lo:hi] += chunk_grads[2]
        return grad_q, grad_k, grad_v, None, None, None


def rows_attention_by_chunks(
    q_rows: Tensor, k: Tensor, v: Tensor, rows: Tensor, valid: Tensor, mask: Tensor | None, *,
    scale: float | None, chunk: int, key_range: KeyRange, rule: Rule, bucket: int | None = None,
) -> tuple[Tensor, int]:
    """Attention of up to `chunk` consecutive selected rows at a time over the keys [lo, hi) that
    `key_range(first row, last row)` gives; `rule(keys, rows)` (see `Rule`) masks keys in the
    range; every row must allow at least its own position (true of causal and window rules), so
    only the key padding `mask` can leave a row without keys.
    With `bucket`, a chunk also never crosses a multiple of `bucket` positions, which bounds its
    spread when the rows are sparse. Returns (out_rows with padding zeroed, executed FLOPs)."""
    batch, heads, count, dim = q_rows.shape
    length, value_dim = k.shape[2], v.shape[-1]
    if count == 0:
        return q_rows.new_zeros(batch, heads, 0, value_dim), 0
    positions = filled_positions(rows, valid)
    starts = chunk_starts(positions, chunk, bucket)
    stops = starts[1:] + [count]
    # One host sync for every chunk's first and last row.
    firsts = positions[:, starts].min(dim=0).values.tolist()
    lasts = positions[:, [stop - 1 for stop in stops]].max(dim=0).values.tolist()
    plan, allowed_masks, flops = [], [], 0
    for start, stop, first, last in zip(starts, stops, firsts, lasts, strict=True):
        lo, hi = key_range(first, last)
        lo, hi = max(lo, 0), min(hi, length)
        allowed = rule(torch.arange(lo, hi, device=k.device)[None, None, :], positions[:, start:stop, None])
        if mask is not None:
            allowed = allowed & mask[:, None, lo:hi]
        plan.append((start, stop, lo, hi))
        allowed_masks.append(allowed[:, None])  # [B, 1, rows, keys]
        flops += batch * heads * dense_attention_flops((stop - start) * (hi - lo), dim, value_dim)
    real = valid[:, None, :, None]
    if not blocked_attention_fits(q_rows, v):
        parts = [sdpa_allowed(q_rows[:, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi], allowed, scale)
                 for (start, stop, lo, hi), allowed in zip(plan, allowed_masks, strict=True)]
        return torch.cat(parts, dim=2) * real.to(q_rows.dtype), flops
    if mask is not None:  # rows whose keys are all padding: zeroed, no gradient
        real = real & torch.cat([allowed.any(dim=-1, keepdim=True) for allowed in allowed_masks], dim=2)
    # The bias in fp32 at least (MASKED does not fit fp16); the chunks compute in fp32 at least.
    bias_dtype = torch.promote_types(q_rows.dtype, torch.float32)
    allowed_bias, excluded_bias = (torch.tensor(value, dtype=bias_dtype, device=q_rows.device)
                                   for value in (0.0, MASKED))

    def bias_of(index: int) -> Tensor:
        # An excluded key gets a large finite negative bias, so a row with no allowed key stays
        # finite.
        return torch.where(allowed_masks[index], allowed_bias, excluded_bias)

    scale = dim ** -0.5 if scale is None else scale
    out = _ChunkedAttention.apply(q_rows, k, v, plan, bias_of, scale)
    return out * real.to(out.dtype), flops
