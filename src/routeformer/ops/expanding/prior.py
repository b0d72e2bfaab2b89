"""Expanding attention's prior and stopping rule (ops/expanding/op.py's module docstring has the
algorithm): the Beta prior's horizon and log decay under the paper's update and under mean-field
inference, each query's useful context, the stopping rule, the argument checks, and the masked
softmax the reference and cached decoding share. Shared by the band path, the C path's caller,
the reference and cached decoding (ops/expanding/decode.py). Pure: torch and the argument
checks only, so the reference may import it."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive

UPDATES = ("paper", "mean_field")
# Mean-field convergence: relative change of E[δ] between two steps (see ops/expanding/op.py).
MEAN_FIELD_RTOL = 1e-3
# Keys outside a horizon get a penalty of at least EXCLUDED / 2: exp() of it is exactly 0, as
# with -inf. Float arithmetic builds it ~5x faster than a bool mask with masked_fill on CPU.
EXCLUDED = 1e30


def check_expanding_options(tol: float, max_iters: int, update: str = "paper") -> None:
    if not (isinstance(tol, float | int) and 0.0 < tol < 1.0):
        raise ValueError(f"tol must be a number in (0, 1); got {tol!r}")
    check_positive("max_iters", max_iters)
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}; got {update!r}")


def mean_field_log_decay(alpha: Tensor, beta: Tensor) -> Tensor:
    """E[log(1 - q)] under Beta(α, β): ψ(β) - ψ(α + β) (the mean-field δ-step's per-unit prior)."""
    return torch.digamma(beta) - torch.digamma(alpha + beta)


def mean_field_horizon(log_decay: Tensor, tol: float, context: Tensor) -> Tensor:
    """ceil(log(tol) / E[log(1 - q)]) clamped to [1, context] (long)."""
    horizon = torch.ceil(math.log(tol) / log_decay.clamp(max=-1e-7))
    return torch.minimum(horizon.clamp(min=1), context.to(horizon.dtype)).long()


def mean_field_converged(mean: Tensor, previous_mean: Tensor) -> Tensor:
    return (mean - previous_mean).abs() <= MEAN_FIELD_RTOL * previous_mean.clamp(min=1.0)


def geometric_horizon(alpha: Tensor, beta: Tensor, tol: float, context: Tensor) -> Tensor:
    """ceil(log(tol) / log(1 - q)) with q = α / (α + β), clamped to [1, context] (long).

    The geometric tail beyond the horizon, P(δ >= H) = (1 - q)^H, is at most `tol`.
    """
    q = alpha / (alpha + beta)
    horizon = torch.ceil(math.log(tol) / torch.log1p(-q.clamp(max=1 - 1e-7)))
    horizon = torch.minimum(horizon.clamp(min=1), context.to(horizon.dtype))
    return horizon.long()


def prior_log_decay(alpha: Tensor, beta: Tensor) -> Tensor:
    """log(1 - q) = log(β / (α + β)): the per-unit-distance log prior (log q cancels in softmax)."""
    return torch.log(beta) - torch.log(alpha + beta)


def query_context(valid: Tensor, causal: bool) -> Tensor:
    """Largest useful horizon per query, long [B, T]: every real key it may read lies at distance
    < context. Measured from the sequence's first real token (causal) and to its last one
    (non-causal), so padding on either side changes no real query's horizon nor its stopping
    rule: a padded sequence runs as it would alone. At least 1 (padded queries included)."""
    length = valid.shape[1]
    positions = torch.arange(length, device=valid.device)
    first = valid.long().argmax(dim=1, keepdim=True)  # 0 for a sequence with no real token
    last = length - 1 - valid.flip(1).long().argmax(dim=1, keepdim=True)
    context = positions - first + 1 if causal else torch.maximum(positions - first, last - positions) + 1
    return context.clamp(min=1)


def stop_now(step: int, max_iters: int, horizon: Tensor, previous: Tensor, context: Tensor) -> Tensor:
    """The stopping rule, shared by the fast path and the reference."""
    not_growing = horizon <= previous if step > 0 else torch.zeros_like(horizon, dtype=torch.bool)
    return not_growing | (horizon >= context) | (step == max_iters - 1)


def check_prior(alpha: Tensor, beta: Tensor, heads: int) -> None:
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value.shape != (heads,):
            raise ValueError(f"{name} must have shape [H] = ({heads},); got {tuple(value.shape)}")
        # The value check reads the tensor (a host sync, a graph break under torch.compile): a
        # graph being traced skips it (the layer's prior is positive by construction).
        if not torch.compiler.is_compiling() and not bool((value > 0).all()):
            raise ValueError(f"{name} must be positive (a Beta concentration); got {value.tolist()}")


def masked_logits(
    scores: Tensor, distance: Tensor, key_valid: Tensor, horizon: Tensor, log_decay: Tensor,
    scale: float, causal: bool,
) -> Tensor:
    """The reference's logits: scores·scale + δ·log(1 - q), keys outside [0, horizon) or padded
    set to -inf. Shapes: scores [.., Lq, Lk], distance broadcastable, horizon/log_decay [.., Lq]."""
    if not causal:
        distance = distance.abs()
    inside = (distance >= 0) & (distance < horizon[..., None]) & key_valid
    logits = scores * scale + distance.to(scores.dtype) * log_decay[..., None]
    return logits.masked_fill(~inside, float("-inf"))


def softmax_rows(logits: Tensor) -> Tensor:
    """Softmax whose all-excluded rows (padded queries) give zeros instead of NaN or uniform.
    Excluded keys are -inf (reference) or <= -EXCLUDED / 2 (fast path)."""
    has_key = logits.amax(dim=-1, keepdim=True) > -EXCLUDED / 4
    return torch.where(has_key, logits, torch.zeros_like(logits)).softmax(dim=-1) * has_key
