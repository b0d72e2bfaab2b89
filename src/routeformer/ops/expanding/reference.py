"""Expanding attention, the specification (`expanding_attention_reference`) and the per-query window
inference it runs (`WindowInference`, which cached decoding, ops/expanding/decode.py, runs too).

Axes: B batch, H heads, T length, d head dim. The algorithm is described in ops/expanding/op.py's
module docstring. Written the obvious way: every q·k product (dense T×T scores), the iterations
with an explicit horizon mask, one softmax per step. Imports torch, the argument checks and the
prior's pure math (ops/expanding/prior.py: horizons, log decays, stopping rule, masked softmax),
never the band path or the C kernels (tests/ops/test_references_independent.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from routeformer.ops._checks import check_qkv
from routeformer.ops.expanding.prior import (
    check_expanding_options,
    check_prior,
    geometric_horizon,
    masked_logits,
    mean_field_converged,
    mean_field_horizon,
    mean_field_log_decay,
    prior_log_decay,
    query_context,
    softmax_rows,
    stop_now,
)


class WindowInference:
    """The per-query state of the window inference that the reference and cached decoding
    (ops/expanding/decode.py) both run: steps taken, Σ E[δ] (geometric update) or the last E[δ]
    (mean field), convergence and the last horizon. `alpha_start`, `beta_start` [B, H, T] are the
    prior's parameters (detached: no gradient flows through the inference steps)."""

    def __init__(self, alpha_start: Tensor, beta_start: Tensor, dtype: torch.dtype, *, mean_field: bool,
                 tol: float, context: Tensor, max_iters: int) -> None:
        self.alpha_start, self.beta_start, self.dtype = alpha_start, beta_start, dtype
        self.mean_field, self.tol, self.context, self.max_iters = mean_field, tol, context, max_iters
        shape, device = alpha_start.shape, alpha_start.device
        self.steps = torch.zeros(shape, dtype=torch.long, device=device)
        self.distance_sum = torch.zeros(shape, dtype=dtype, device=device)
        self.last_mean = torch.zeros_like(self.distance_sum)  # mean field: E[δ] of the last step
        self.previous = torch.zeros_like(self.steps)
        self.converged = torch.zeros(shape, dtype=torch.bool, device=device)

    def propose(self, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """(horizon, stop, log decay) of inference step `step` from the state so far."""
        if self.mean_field:
            decay = mean_field_log_decay(self.alpha_start + (self.steps > 0).to(self.dtype),
                                          self.beta_start + self.last_mean)
            return (mean_field_horizon(decay, self.tol, self.context),
                    self.converged | (step == self.max_iters - 1), decay)
        alpha_t, beta_t = self.alpha_start + self.steps, self.beta_start + self.distance_sum
        horizon = geometric_horizon(alpha_t, beta_t, self.tol, self.context)
        return horizon, stop_now(step, self.max_iters, horizon, self.previous, self.context), \
            prior_log_decay(alpha_t, beta_t)

    def advance(self, new_horizon: Tensor, going_on: Tensor, mean: Tensor) -> None:
        """Take the step for the queries `going_on`, whose window gave E[δ] = `mean`."""
        if self.mean_field:
            self.converged = going_on & (self.steps > 0) & mean_field_converged(mean, self.last_mean)
            self.last_mean = torch.where(going_on, mean, self.last_mean)
        else:
            self.distance_sum += torch.where(going_on, mean, 0.0)
        self.steps += going_on.long()
        self.previous = new_horizon

    def final_log_decay(self, alpha_start: Tensor, beta_start: Tensor) -> Tensor:
        """The posterior's log decay after the steps taken, from `alpha_start`, `beta_start` (the
        reference passes them undetached: the final pass is where α, β learn)."""
        if self.mean_field:
            return mean_field_log_decay(alpha_start + (self.steps > 0).to(self.dtype),
                                         beta_start + self.last_mean)
        return prior_log_decay(alpha_start + self.steps, beta_start + self.distance_sum)


def expanding_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, *, tol: float = 0.01,
    max_iters: int = 8, mask: Tensor | None = None, causal: bool = True, scale: float | None = None,
    update: str = "paper",
) -> tuple[Tensor, Tensor, Tensor]:
    """The specification: every q·k product, the iterations with an explicit horizon mask.

    Returns (out [B, H, T, d], horizon [B, H, T], iterations [B, H, T])."""
    check_qkv(q, k, v, mask, causal=True)
    check_expanding_options(tol, max_iters, update)
    batch, heads, length, dim = q.shape
    check_prior(alpha, beta, heads)
    scale = dim ** -0.5 if scale is None else scale
    positions = torch.arange(length, device=q.device)
    distance = positions[:, None] - positions[None, :]  # δ = i - j
    key_valid = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=q.device)
    if mask is not None:
        key_valid = mask[:, None, None, :]
    context = query_context(key_valid[:, 0, 0, :].expand(batch, length), causal)[:, None, :].expand(
        batch, heads, length)
    scores = q @ k.transpose(-1, -2)
    alpha_start = alpha.view(1, heads, 1).expand(batch, heads, length)
    beta_start = beta.view(1, heads, 1).expand(batch, heads, length)
    inference = WindowInference(alpha_start.detach(), beta_start.detach(), scores.dtype,
                                mean_field=update == "mean_field", tol=tol, context=context,
                                max_iters=max_iters)
    horizon = torch.ones_like(inference.steps)
    # Padded queries take no inference step: their window stays the prior's.
    active = key_valid[:, :, 0, :].expand(batch, heads, length).clone()
    with torch.no_grad():
        for step in range(max_iters):
            new_horizon, stop, step_decay = inference.propose(step)
            horizon = torch.where(active | (step == 0), new_horizon, horizon)
            probs = softmax_rows(masked_logits(scores, distance, key_valid, horizon, step_decay, scale,
                                                 causal))
            lengths = distance if causal else distance.abs()
            going_on = active & ~stop
            inference.advance(new_horizon, going_on, (probs * lengths.to(probs.dtype)).sum(-1))
            active = going_on
    log_decay = inference.final_log_decay(alpha_start, beta_start)
    probs = softmax_rows(masked_logits(scores, distance, key_valid, horizon, log_decay, scale, causal))
    return probs @ v, horizon, inference.steps + 1
