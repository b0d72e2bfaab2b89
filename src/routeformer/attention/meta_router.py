"""The Bayesian meta-controller of Meta-Attention (Ferrari): an amortised Dirichlet posterior over
which expert attends for each token.

    prior        Dir(β),  β_i = ε + β₀ (1 − c_i)                                   (Eq. 1)
    increments   δ(x_t) = softplus(W₂ GELU(W₁ [LayerNorm(x_t); ‖x_t‖/√D; pos_t]))     (Eq. 4)
    posterior    q(α | x_t) = Dir(β̂_t),  β̂_t = β + δ(x_t)                          (Eq. 3)
    routing      ᾱ_t = β̂_t / Σ_i β̂_t,i  (posterior mean, Eq. 5)

With `prior="none"` (the prior-free ablation) β̂_t = ε + δ(x_t): the floor ε keeps the Dirichlet
proper, and the cost prior is no longer part of the posterior; only the layer's KL term (if its
`elbo_weight` > 0) still pulls toward it. `prior` is kept as the KL's target either way.

`pos_t` is position / `position_scale` (default 1024: a fixed scale, so a token's routing depends on
its position only, never on the length of the sequence it sits in). `position_scale=None` is the
paper's linspace(0, 1, T) — position / (T − 1) — which depends on the (padded) sequence length: a
token then routes differently when the same text is cut at a different length or padded, so
training, evaluation at another length and token-by-token decoding compute different functions.
That form is kept for reproducing the paper only; the layer contract's prefix and padding
invariants (docs/design.md) hold with a fixed scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PRIOR_KINDS = ("dirichlet", "none")
DEFAULT_POSITION_SCALE = 1024.0


def cost_prior(costs: Sequence[float], beta0: float, eps: float) -> Tensor:
    """β_i = ε + β₀ (1 − c_i) (Eq. 1), refusing any β_i ≤ 0 (an improper Dirichlet)."""
    if not eps > 0:
        raise ValueError(f"prior_eps must be > 0 (it keeps every concentration positive); got {eps!r}")
    if not beta0 >= 0:
        raise ValueError(f"beta0 must be >= 0; got {beta0!r}")
    if any(not cost >= 0 for cost in costs):
        raise ValueError(f"costs must be >= 0; got {tuple(costs)}")
    prior = [eps + beta0 * (1.0 - cost) for cost in costs]
    bad = [i for i, value in enumerate(prior) if not value > 0]
    if bad:
        raise ValueError(
            f"costs {tuple(costs)} with beta0={beta0} and prior_eps={eps} give prior concentrations "
            f"{[round(p, 4) for p in prior]}: expert(s) {bad} would be <= 0 (an improper Dirichlet). "
            f"Every cost must be < 1 + prior_eps / beta0 = {1 + eps / beta0 if beta0 else math.inf:.4g}."
        )
    return torch.tensor(prior)


class BayesianRouter(nn.Module):
    """x [B, T, D], positions [B, T] -> posterior concentrations β̂ [B, T, K]; see the module docstring."""

    def __init__(
        self, dim: int, costs: Sequence[float], *, beta0: float = 1.0, eps: float = 0.01,
        hidden: int = 64, prior: str = "dirichlet", position_scale: float | None = DEFAULT_POSITION_SCALE,
    ) -> None:
        super().__init__()
        if prior not in PRIOR_KINDS:
            raise ValueError(f"prior must be one of {PRIOR_KINDS}; got {prior!r}")
        if position_scale is not None and not position_scale > 0:
            raise ValueError(f"position_scale must be > 0 or None; got {position_scale!r}")
        self.register_buffer("prior", cost_prior(costs, beta0, eps), persistent=False)
        self.use_prior, self.eps, self.position_scale = prior == "dirichlet", eps, position_scale
        self.norm = nn.LayerNorm(dim)
        self.hidden = nn.Linear(dim + 2, hidden)
        self.increments = nn.Linear(hidden, len(costs))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        dim, length = x.shape[-1], x.shape[1]
        salience = x.norm(dim=-1, keepdim=True) / math.sqrt(dim)
        scale = float(max(length - 1, 1)) if self.position_scale is None else self.position_scale
        # Divide in fp32 at least: bf16 holds integers exactly only up to 256.
        position = (positions.to(torch.promote_types(x.dtype, torch.float32)) / scale).to(x.dtype)[..., None]
        features = torch.cat([self.norm(x), salience, position], dim=-1)
        delta = F.softplus(self.increments(F.gelu(self.hidden(features))))
        base = self.prior.to(x.dtype) if self.use_prior else x.new_full((1,), self.eps)
        return base + delta
