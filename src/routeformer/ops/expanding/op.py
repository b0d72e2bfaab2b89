"""Expanding attention: a geometric prior over edge distance whose window is inferred per query.

Axes: B batch, H heads, T length, d head dim; N query blocks of b tokens, R = B·H·N block rows,
W = key slots of a block row's band (rings · b).

Singh & Buckley ("Attention as Implicit Structural Inference", NeurIPS 2023, §4) replace the
uniform prior over which key a query connects to by a geometric prior over the distance δ = i - j,
p(δ | q) = q (1 - q)^δ, with a conjugate Beta(α, β) hyper-prior on q. Truncated mean-field
inference, per query:
    1. q_t = α_t / (α_t + β_t)
    2. p_t = softmax over the keys within the horizon H_t = ceil(log(tol) / log(1 - q_t)) of
             q·k·scale + log p(δ | q_t)          (the tail beyond H_t holds at most `tol` prior mass)
    3. α_{t+1} = α_t + 1,  β_{t+1} = β_t + Σ_δ δ p_t(δ)
until the horizon stops growing, reaches the context, or `max_iters` steps were taken; the output
is p_t V of the last step. Content far back (large expected δ) lowers q and widens the window.

Non-causal (our extension): δ = |i - j| and the horizon is two-sided.

This update (`update="paper"`, the default; every experiment uses it except the mean-field rows
of structural-recency) is **not a
mean-field step** and does not converge to a mean-field fixed point: it adds one pseudo-observation
of the same edge per iteration (α_t = α + t, β_t = β + Σ_s E_s[δ]), so after t steps the posterior
counts the single edge t times, and it plugs in log(1 - E[q]) instead of E[log(1 - q)]. Where it
stops is set by a heuristic (the horizon stopped growing) and by `max_iters`, and its output
depends on the cap: `routeformer reproduce structural-update` measured 7.8 % of queries stopped by
the default cap of 8 and outputs moved by up to 0.26 against an uncapped run (random inputs).

`update="mean_field"` is coordinate-ascent mean-field inference for one query's latent edge δ and
decay q under q(δ) q(q):
    q-step: q(q) = Beta(α + 1, β + E_t[δ])        (the prior plus the one edge, not accumulated)
    δ-step: p_{t+1}(δ) ∝ exp(q·k·scale + δ E[log(1 - q)]),  E[log(1 - q)] = ψ(β_t) - ψ(α_t + β_t)
with the horizon ceil(log(tol) / E[log(1 - q)]). E_{t+1}[δ] is an increasing function of E_t[δ]
(a larger mean distance lowers the decay, which moves mass further back), so the sequence E_t[δ]
is monotone and bounded by the context: it converges. A query stops once
|E_t[δ] - E_{t-1}[δ]| <= 1e-3 · max(1, E_{t-1}[δ]) (`MEAN_FIELD_RTOL`), or at `max_iters`.
It runs on the band path (not the C kernels).

Band path. The sequence is cut into blocks of b queries; a block's keys are organised in rings:
ring o holds the key block o blocks back (o < 0: ahead). The q·k products of ring o are computed
for a block row only once some query of the block needs them (its horizon reaches that ring) and
are kept for every later iteration (one [R, b, b] tensor per ring), so keys beyond the block's
largest horizon are never scored. Each iteration runs a masked softmax over the block rows with a
query still iterating or, once fewer than half the queries iterate, over those queries alone
(gathered). The final pass, one autograd function, applies the last softmax to the values ring by
ring; its backward rebuilds the probabilities from the cache and adds the key and value gradients
in place, ring by ring.

C kernels (ops/native; causal, unpadded, CPU, when a compiler exists; custom ops, so also under
torch.compile; bf16/fp16 computed in fp32), which the op prefers: the inference steps run per
query over exactly its horizon (expanding_kernels.c, vectorised in fp32), the final pass is
query-blocked (band_kernels.c) and its backward runs per query. The band path above serves padded
and bidirectional inputs and GPU.

Gradients: to q, k, v through the final softmax, and to α, β through the prior of the final step,
with α_T = α + (steps taken) and β_T = β + Σ_t E_t[δ]; the E_t[δ] of the mean-field iterations are
treated as constants (no backpropagation through the inference loop), and the integer horizon has
no gradient.

Reference (ops/expanding/reference.py): dense T×T scores, the same iterations with an explicit
horizon mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from routeformer.ops._checks import check_positive, check_qkv
from routeformer.ops.backends import NATIVE, TRITON, expanding_backend, expanding_final_pass_backend
from routeformer.ops.expanding.band import BandAttention, BandRings
from routeformer.ops.expanding.prior import (
    UPDATES,
    check_expanding_options,
    check_prior,
    geometric_horizon,
    mean_field_converged,
    mean_field_horizon,
    mean_field_log_decay,
    prior_log_decay,
    query_context,
    stop_now,
)
from routeformer.ops.native import native_kernels
from routeformer.ops.native.band import NativeBandAttention, expanding_infer_op
from routeformer.ops.native.kernel_flops import band_attend_flops_tensor

# The op's names; UPDATES (the values `update` takes) lives with the prior and is part of them.
__all__ = ["DEFAULT_BLOCK", "UPDATES", "ExpandingOutput", "expanding_attention", "expanding_uses_native"]

DEFAULT_BLOCK = 64
# Elementwise work per (query, key) entry of one inference step: prior, mask, exp, sum, δ·p.
_STEP_FLOPS_PER_ENTRY = 5


@dataclass
class ExpandingOutput:
    out: Tensor  # [B, H, T, d]
    horizon: Tensor  # long [B, H, T]: final window (keys at distance < horizon are read)
    iterations: Tensor  # long [B, H, T]: inference steps taken
    # The counts are ints, or 0-d long tensors where `expanding_attention(..., sync_stats=False)`
    # took the native path (read them without a host sync, e.g. inside a compiled graph).
    scored_pairs: int | Tensor  # q·k products computed (at block granularity), counted once each
    value_pairs: int | Tensor  # (query, key) pairs of the final P·V products (the whole band)
    step_entries: int | Tensor  # (query, key) entries the inference steps and the final softmax touched
    flops: int | Tensor  # executed FLOPs: scores + P·V + elementwise inference work


def _expanding_native(
    native, q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, tol: float, max_iters: int,
    scale: float, sync_stats: bool,
) -> ExpandingOutput:
    """Causal, unpadded expanding attention by the C kernels: the inference steps per query (no
    gradient), then the final pass with log(1 - q) from the learnable α, β plus the counts.
    sync_stats=False leaves the counts as 0-d long tensors (no host sync: under torch.compile the
    whole path is one graph, custom ops included)."""
    batch, heads, length, dim = q.shape
    rows = batch * heads
    q_rows, k_rows, v_rows = (t.reshape(rows, length, -1) for t in (q, k, v))
    # Custom ops (ops/native/band.py): compile-safe; bf16/fp16 computed in fp32, and the prior's
    # statistics kept in fp32 (the δ·log(1 - q) prior needs the digits).
    horizon, steps, distance_sum, counts = expanding_infer_op(
        q_rows.detach(), k_rows.detach(), alpha.detach(), beta.detach(), heads, float(tol), max_iters, scale)
    stats_dtype = distance_sum.dtype
    per_query = (lambda per_head: per_head.to(stats_dtype).view(1, heads, 1).expand(batch, heads, length)
                 .reshape(rows, length))
    log_decay = prior_log_decay(per_query(alpha) + steps, per_query(beta) + distance_sum).contiguous()
    out = NativeBandAttention.apply(q_rows, k_rows, v_rows, log_decay, horizon, scale, native)
    # The final pass as the query-blocked kernel executes it (whole key tiles, three-query groups).
    final_pass = band_attend_flops_tensor(horizon, torch.arange(length).expand(rows, length), dim,
                                          v.shape[-1])
    value_pairs, step_scored, step_entries = horizon.sum(), counts[0], counts[1]
    scored_pairs = step_scored + value_pairs  # the final pass scores its keys again
    step_entries = step_entries + value_pairs
    flops = 2 * dim * step_scored + final_pass + _STEP_FLOPS_PER_ENTRY * step_entries
    totals = (scored_pairs, value_pairs, step_entries, flops)
    if sync_stats:  # one host sync for every statistic
        totals = torch.stack(totals).tolist()
    return ExpandingOutput(
        out=out.view(batch, heads, length, -1), horizon=horizon.view(batch, heads, length),
        iterations=(steps + 1).view(batch, heads, length), scored_pairs=totals[0],
        value_pairs=totals[1], step_entries=totals[2], flops=totals[3],
    )


def _final_pass_triton(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, horizon: Tensor, scale: float,
                       block: int) -> Tensor:
    """The final pass of the causal, unpadded band path on the Triton banded pass, in its layout:
    q, k, v [B, H, P, d|e] padded to whole blocks, log_decay and horizon [B·H·P / b, b] -> out
    [B·H·P / b, b, e]. Each query reads the `horizon` keys ending at itself under the δ·log_decay
    prior, with the gradient to log_decay (the learnable α, β)."""
    from routeformer.ops.triton.band import triton_band_attention  # triton is optional

    batch, heads, padded, dim = q.shape
    rows = batch * heads
    out = triton_band_attention(q.reshape(rows, padded, dim), k, v, log_decay.reshape(rows, padded),
                                horizon.reshape(rows, padded), scale=scale)
    return out.view(-1, block, v.shape[-1])


def expanding_uses_native(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
                          update: str) -> bool:
    """Whether `expanding_attention` runs these inputs on the C kernels: causal, unpadded, the
    paper's update (the only one the kernels implement), tensors the kernels take."""
    return expanding_backend(q, k, v, mask=mask, causal=causal, update=update)[0] == NATIVE


def expanding_attention(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, *, tol: float = 0.01,
    max_iters: int = 8, mask: Tensor | None = None, causal: bool = True, scale: float | None = None,
    block: int = DEFAULT_BLOCK, update: str = "paper", sync_stats: bool = True,
) -> ExpandingOutput:
    """Expanding attention over [B, H, T, d] tensors; `alpha`, `beta` [H] are the Beta prior's
    positive concentrations (the starting point of every query's inference). `update`: "paper"
    (the paper's accumulating update, which does not converge) or "mean_field" (a true
    coordinate-ascent step, which does). See the module docstring.

    sync_stats=False: on the native path (`expanding_uses_native`) the counts of the result stay
    0-d long tensors, so torch.compile traces the whole op as one graph (its kernels are custom
    ops). The band path reads data-dependent sizes and always returns ints."""
    check_qkv(q, k, v, mask, causal=True)
    check_expanding_options(tol, max_iters, update)
    check_positive("block", block)
    batch, heads, length, dim = q.shape
    check_prior(alpha, beta, heads)
    scale = dim ** -0.5 if scale is None else scale
    # The C kernels (ops/native) for causal, unpadded inputs: faster than the band path below at
    # every prior measured, from 47-key windows to the whole context (T = 1024-16384;
    # docs/results/structural.md).
    if expanding_uses_native(q, k, v, mask=mask, causal=causal, update=update):
        return _expanding_native(native_kernels(q, k, v), q, k, v, alpha, beta, tol, max_iters, scale,
                                 sync_stats)
    if torch.is_autocast_enabled(q.device.type):  # the band path computes in fp32 (below)
        with torch.autocast(q.device.type, enabled=False):
            return expanding_attention(q, k, v, alpha, beta, tol=tol, max_iters=max_iters, mask=mask,
                                       causal=causal, scale=scale, block=block, update=update,
                                       sync_stats=sync_stats)
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    if q.dtype != compute_dtype:
        # bf16/fp16 run in fp32 (autograd casts the gradients back): the band's distances and
        # horizons are not exact in bf16 beyond 256, the δ·log(1 - q) prior loses the scores'
        # digits, and the exclusion penalty overflows fp16. Memory: fp32 copies of q, k, v, O(T·d).
        result = expanding_attention(
            q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype), alpha, beta, tol=tol,
            max_iters=max_iters, mask=mask, causal=causal, scale=scale, block=block, update=update)
        return replace(result, out=result.out.to(q.dtype))
    block = min(block, length)  # a block longer than the sequence would only score padding
    blocks = -(-length // block)
    pad = blocks * block - length
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        valid = F.pad(valid, (0, pad), value=False)
    masked = mask is not None
    rings = BandRings(q.detach(), k.detach(), valid, block, causal, check_keys=masked or not causal,
                      scale=scale)
    shape = (rings.rows, block)
    positions = torch.arange(blocks * block, device=q.device)
    context = query_context(valid, causal)[:, None, :].expand(batch, heads, -1).reshape(shape)
    is_query = (positions < length).view(1, 1, -1).expand(batch, heads, -1).reshape(shape)
    stats_dtype = torch.promote_types(q.dtype, torch.float32)

    def per_query(per_head: Tensor) -> Tensor:  # [H] -> [R, b]
        per_head = per_head.to(stats_dtype).view(1, heads, 1, 1)
        return per_head.expand(batch, heads, blocks, block).reshape(shape)

    alpha_start, beta_start = per_query(alpha.detach()), per_query(beta.detach())
    steps = torch.zeros(shape, dtype=torch.long, device=q.device)
    expected_distance_sum = torch.zeros(shape, dtype=stats_dtype, device=q.device)
    horizon = torch.ones(shape, dtype=torch.long, device=q.device)
    previous = torch.zeros_like(horizon)
    # Padded queries take no inference step: their window stays the prior's.
    active = is_query & rings.key_valid
    step_entries = 0
    mean_field = update == "mean_field"
    # mean_field: E[δ] of the last step, and the queries whose E[δ] has converged (they take one
    # more step to set their horizon from it, then stop).
    last_mean = torch.zeros(shape, dtype=stats_dtype, device=q.device)
    converged = torch.zeros_like(is_query)
    for step in range(max_iters):
        if mean_field:
            step_decay = mean_field_log_decay(alpha_start + (steps > 0).to(stats_dtype),
                                               beta_start + last_mean)
            new_horizon = mean_field_horizon(step_decay, tol, context)
            stop = converged | (step == max_iters - 1)
        else:
            alpha_t, beta_t = alpha_start + steps, beta_start + expected_distance_sum
            new_horizon = geometric_horizon(alpha_t, beta_t, tol, context)
            stop = stop_now(step, max_iters, new_horizon, previous, context)
            step_decay = prior_log_decay(alpha_t, beta_t)
        horizon = torch.where(is_query & (active | (step == 0)), new_horizon, horizon)
        rings.compute(horizon)  # the final pass reuses these products
        going_on = active & ~stop
        if bool(going_on.any()):
            with torch.no_grad():  # the inference steps pass no gradient (module docstring)
                mean_distance, entries = rings.mean_distance(going_on, horizon, step_decay)
            step_entries += entries
            if mean_field:
                converged = going_on & (steps > 0) & mean_field_converged(mean_distance, last_mean)
                last_mean = torch.where(going_on, mean_distance, last_mean)
            else:
                expected_distance_sum += torch.where(going_on, mean_distance, 0.0)
            steps += going_on.long()
        previous = new_horizon
        active = going_on
        if not bool(active.any()):
            break
    # Final step with gradients: the prior's q from the learnable α, β plus the inferred counts.
    if mean_field:
        log_decay = mean_field_log_decay(per_query(alpha) + (steps > 0).to(stats_dtype),
                                          per_query(beta) + last_mean)
    else:
        log_decay = prior_log_decay(per_query(alpha) + steps, per_query(beta) + expected_distance_sum)
    if expanding_final_pass_backend(q, causal, masked)[0] == TRITON:
        out = _final_pass_triton(q, k, v, log_decay, horizon, scale, block)
    else:
        out = BandAttention.apply(q.reshape(rings.rows, block, dim), k.reshape(rings.rows, block, dim),
                                   v.reshape(rings.rows, block, -1), log_decay, rings, horizon, scale)
    step_entries += rings.rows * block * rings.width
    unpadded = (slice(None), slice(None), slice(0, length))
    final_steps = steps + is_query.long()  # the final step counts as one
    band_pairs = rings.rows * block * rings.width
    flops = (2 * dim * rings.scored_pairs + 2 * v.shape[-1] * band_pairs
             + _STEP_FLOPS_PER_ENTRY * step_entries)
    return ExpandingOutput(
        out=out.view(batch, heads, blocks * block, -1)[unpadded],
        horizon=horizon.view(batch, heads, -1)[unpadded],
        iterations=final_steps.view(batch, heads, -1)[unpadded],
        scored_pairs=rings.scored_pairs,
        value_pairs=band_pairs,
        step_entries=step_entries,
        flops=flops,
    )
