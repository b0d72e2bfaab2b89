"""Triton kernel: the banded softmax pass with a per-query horizon and distance decay, forward and
backward — expanding attention's windowed (final) pass, and the causal local window of
Meta-Attention's routed rows.

Axes: B batch, H heads, T keys, M queries per (b, h) row, d key dim, e value dim, δ distance back.
The same computation as the C kernel of `routeformer.ops.native.band` (its docstring):

    out[m] = Σ_{δ < H[m], p − δ >= 0} softmax_δ(q[m]·k[p − δ]·scale + δ·log_decay[m]) v[p − δ]

with p the query's key position (`positions[b, m]`, or m itself). Expanding attention
(ops/expanding/op.py) gets log_decay = log(1 − q_t) of its Beta prior and H from its inference
steps; the local expert of hard-routed `meta` (ops/routed_rows.py) has log_decay = 0 and
H = min(window, p + 1). A query with H = 0 returns zeros.

One program serves BLOCK_M queries of one (b, h) row and walks δ = 0 .. max H of the block,
BLOCK_K distances at a time, with the online softmax in fp32: memory O(M·d), no T x T mask. The
backward recomputes the probabilities from the saved lse and returns gradients to q, k, v (fp32
atomic adds: several queries read one key) and log_decay (d logit / d log_decay = δ, so
grad log_decay[m] = Σ_δ dS[m, δ] δ) — expanding attention's α, β learn through it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from routeformer.ops.triton._common import (
    check_device,
    check_float,
    kernel,
    load_backward_rows,
    next_power_of_2,
)


@kernel
def _band_forward_kernel(
    Q, K, V, DECAY, HORIZON, POSITIONS, OUT, LSE,
    heads, queries, num_keys, dim, value_dim, scale,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B·H·T·d may pass 2³¹
    b = bh // heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < queries
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    d_ok = offs_d < dim
    e_ok = offs_e < value_dim
    q = tl.load(Q + bh * queries * dim + rows[:, None] * dim + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    decay = tl.load(DECAY + bh * queries + rows, mask=row_ok, other=0.0).to(tl.float32)
    horizon = tl.load(HORIZON + bh * queries + rows, mask=row_ok, other=0)
    if HAS_POSITIONS:
        position = tl.load(POSITIONS + b * queries + rows, mask=row_ok, other=0)
    else:
        position = rows
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range(0, tl.max(horizon, axis=0), BLOCK_K):
        distance = start + tl.arange(0, BLOCK_K)
        key = position[:, None] - distance[None, :]
        ok = row_ok[:, None] & (distance[None, :] < horizon[:, None]) & (key >= 0) & (key < num_keys)
        keys = tl.load(K + bh * num_keys * dim + key[:, :, None] * dim + offs_d[None, None, :],
                       mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
        logits = tl.sum(q[:, None, :] * keys, axis=2) * scale \
            + distance[None, :].to(tl.float32) * decay[:, None]
        logits = tl.where(ok, logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        alpha = tl.exp(row_max - safe_max)
        weights = tl.exp(logits - safe_max[:, None])
        total = total * alpha + tl.sum(weights, axis=1)
        values = tl.load(V + bh * num_keys * value_dim + key[:, :, None] * value_dim + offs_e[None, None, :],
                         mask=ok[:, :, None] & e_ok[None, None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * values, axis=1)
        row_max = new_max
    nonempty = total > 0.0
    out = acc / tl.where(nonempty, total, 1.0)[:, None]
    lse = tl.where(nonempty, row_max + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    tl.store(OUT + bh * queries * value_dim + rows[:, None] * value_dim + offs_e[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & e_ok[None, :])
    tl.store(LSE + bh * queries + rows, lse, mask=row_ok)


@kernel
def _band_backward_kernel(
    Q, K, V, DECAY, HORIZON, POSITIONS, OUT, LSE, GRAD_OUT, GRAD_Q, GRAD_K, GRAD_V, GRAD_DECAY,
    heads, queries, num_keys, dim, value_dim, scale,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B·H·T·d may pass 2³¹
    b = bh // heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < queries
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    d_ok = offs_d < dim
    e_ok = offs_e < value_dim
    q, out, grad_out, lse, qd_mask, qe_mask = load_backward_rows(
        Q, OUT, GRAD_OUT, LSE, bh, rows, row_ok, offs_d, offs_e, d_ok, e_ok, queries, dim, value_dim)
    decay = tl.load(DECAY + bh * queries + rows, mask=row_ok, other=0.0).to(tl.float32)
    horizon = tl.load(HORIZON + bh * queries + rows, mask=row_ok, other=0)
    if HAS_POSITIONS:
        position = tl.load(POSITIONS + b * queries + rows, mask=row_ok, other=0)
    else:
        position = rows
    delta = tl.sum(grad_out * out, axis=1)
    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    grad_decay = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, tl.max(horizon, axis=0), BLOCK_K):
        distance = start + tl.arange(0, BLOCK_K)
        key = position[:, None] - distance[None, :]
        ok = row_ok[:, None] & (distance[None, :] < horizon[:, None]) & (key >= 0) & (key < num_keys)
        kd_mask = ok[:, :, None] & d_ok[None, None, :]
        ve_mask = ok[:, :, None] & e_ok[None, None, :]
        k_rows = bh * num_keys * dim + key[:, :, None] * dim
        v_rows = bh * num_keys * value_dim + key[:, :, None] * value_dim
        keys = tl.load(K + k_rows + offs_d[None, None, :], mask=kd_mask, other=0.0).to(tl.float32)
        values = tl.load(V + v_rows + offs_e[None, None, :], mask=ve_mask, other=0.0).to(tl.float32)
        logits = tl.sum(q[:, None, :] * keys, axis=2) * scale \
            + distance[None, :].to(tl.float32) * decay[:, None]
        weights = tl.where(ok, tl.exp(logits - lse[:, None]), 0.0)
        grad_logits = weights * (tl.sum(grad_out[:, None, :] * values, axis=2) - delta[:, None])
        grad_decay += tl.sum(grad_logits * distance[None, :].to(tl.float32), axis=1)
        grad_logits = grad_logits * scale
        grad_q += tl.sum(grad_logits[:, :, None] * keys, axis=1)
        tl.atomic_add(GRAD_K + k_rows + offs_d[None, None, :], grad_logits[:, :, None] * q[:, None, :],
                      mask=kd_mask)
        tl.atomic_add(GRAD_V + v_rows + offs_e[None, None, :], weights[:, :, None] * grad_out[:, None, :],
                      mask=ve_mask)
    tl.store(GRAD_Q + bh * queries * dim + rows[:, None] * dim + offs_d[None, :],
             grad_q.to(GRAD_Q.dtype.element_ty), mask=qd_mask)
    tl.store(GRAD_DECAY + bh * queries + rows, grad_decay, mask=row_ok)


def _blocks(dim: int, value_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_D, BLOCK_E): register-sized on a GPU, large in the interpreter."""
    if device.type == "cpu":
        return 32, 64, next_power_of_2(dim), next_power_of_2(value_dim)
    return 16, 16, next_power_of_2(dim), next_power_of_2(value_dim)


class _TritonBand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_decay, horizon, positions, scale):
        batch, heads, num_keys, dim = k.shape
        queries, value_dim = q.shape[1], v.shape[-1]
        out = q.new_empty(q.shape[0], queries, value_dim)
        lse = torch.empty(q.shape[0], queries, dtype=torch.float32, device=q.device)
        blocks = _blocks(dim, value_dim, q.device)
        if out.numel():
            _band_forward_kernel[(triton.cdiv(queries, blocks[0]), batch * heads)](
                q, k, v, log_decay, horizon, horizon if positions is None else positions, out, lse,
                heads, queries, num_keys, dim, value_dim, scale, HAS_POSITIONS=positions is not None,
                BLOCK_M=blocks[0], BLOCK_K=blocks[1], BLOCK_D=blocks[2], BLOCK_E=blocks[3])
        ctx.save_for_backward(q, k, v, log_decay, horizon, positions, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, log_decay, horizon, positions, out, lse = ctx.saved_tensors
        batch, heads, num_keys, dim = k.shape
        queries, value_dim = q.shape[1], v.shape[-1]
        grad_q = torch.zeros_like(q)
        grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        grad_decay = torch.zeros(log_decay.shape, dtype=torch.float32, device=q.device)
        blocks = _blocks(dim, value_dim, q.device)
        if out.numel():
            _band_backward_kernel[(triton.cdiv(queries, blocks[0]), batch * heads)](
                q, k, v, log_decay, horizon, horizon if positions is None else positions, out, lse,
                grad_out.contiguous(), grad_q, grad_k, grad_v, grad_decay,
                heads, queries, num_keys, dim, value_dim, ctx.scale, HAS_POSITIONS=positions is not None,
                BLOCK_M=blocks[0], BLOCK_K=blocks[1], BLOCK_D=blocks[2], BLOCK_E=blocks[3])
        return (grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype), grad_decay.to(log_decay.dtype),
                None, None, None)


def triton_band_attention(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor,
                          positions: Tensor | None = None, *, scale: float | None = None) -> Tensor:
    """The banded pass (module docstring): q [B·H, M, d], k [B, H, T, d], v [B, H, T, e],
    log_decay [B·H, M] (differentiable), horizon long [B·H, M], positions long [B, M] or None
    (query m at key position m) -> out [B·H, M, e] in q's dtype."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.dim() != 3 \
            or q.shape[0] != k.shape[0] * k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError("q, k, v must be [B·H, M, d], [B, H, T, d], [B, H, T, e]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if log_decay.shape != q.shape[:2] or horizon.shape != q.shape[:2] or horizon.dtype != torch.long:
        raise ValueError(f"log_decay and horizon (long) must be [B·H, M] = {tuple(q.shape[:2])}; got "
                         f"{tuple(log_decay.shape)} and {horizon.dtype} {tuple(horizon.shape)}")
    if positions is not None and (positions.shape != (k.shape[0], q.shape[1])
                                  or positions.dtype != torch.long):
        raise ValueError(f"positions must be long [B, M] = {(k.shape[0], q.shape[1])}; "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_float(name, tensor)
    check_device(*(t for t in (q, k, v, log_decay, horizon, positions) if t is not None))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    positions = None if positions is None else positions.contiguous()
    out, _ = _TritonBand.apply(q.contiguous(), k.contiguous(), v.contiguous(), log_decay.contiguous(),
                               horizon.contiguous(), positions, scale)
    return out


def band_flops(horizon: Tensor, dim: int, value_dim: int) -> int:
    """FLOPs the kernel executes for horizon [B·H, M]: each block of BLOCK_M queries walks whole
    BLOCK_K tiles up to its largest horizon (masked lanes included), scoring and weighting."""
    block_m, block_k, _, _ = _blocks(dim, value_dim, horizon.device)
    rows, queries = horizon.shape
    if horizon.numel() == 0:
        return 0
    padded = torch.nn.functional.pad(horizon, (0, -queries % block_m))
    reach = padded.view(rows, -1, block_m).amax(dim=-1)
    tiles = (reach + block_k - 1) // block_k
    return int(tiles.sum()) * block_m * block_k * 2 * (dim + value_dim)
