"""Closed forms for Dirichlet distributions, batched over leading axes (the `meta` controller).

Axes: ... any leading axes, K categories (the last axis). Concentrations must be > 0.

- `log_multivariate_beta(c)`  = Σ lgamma(c_i) − lgamma(Σ c_i)                      (log B(c))
- `dirichlet_entropy(c)`      = log B(c) + (c₀ − K) ψ(c₀) − Σ (c_i − 1) ψ(c_i)      (Meta-Attention Eq. 6)
- `dirichlet_kl(c, p)`        = log B(p) − log B(c) + Σ (c_i − p_i) ψ(c_i) − (c₀ − p₀) ψ(c₀)  (Eq. 9)
with c₀ = Σ c_i. Tests compare them with `torch.distributions`.

The entropy is a differential entropy: it is at most −log Γ(K) (the uniform Dirichlet(1, …, 1),
the maximum-entropy density on the simplex) and unbounded below (concentrations → 0 push the
mass onto the corners). `normalised_certainty` turns it into a number in [0, 1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def log_multivariate_beta(concentration: Tensor) -> Tensor:
    return torch.lgamma(concentration).sum(-1) - torch.lgamma(concentration.sum(-1))


def dirichlet_entropy(concentration: Tensor) -> Tensor:
    """Differential entropy of Dir(concentration), Eq. 6 of the Meta-Attention preprint."""
    categories = concentration.shape[-1]
    total = concentration.sum(-1)
    return (
        log_multivariate_beta(concentration)
        + (total - categories) * torch.digamma(total)
        - ((concentration - 1.0) * torch.digamma(concentration)).sum(-1)
    )


def dirichlet_kl(concentration: Tensor, prior: Tensor) -> Tensor:
    """KL[Dir(concentration) || Dir(prior)], Eq. 9; `prior` broadcasts against `concentration`."""
    # The prior's terms at its own shape (one [K] prior: K + 1 lgamma calls, not per token).
    total = concentration.sum(-1)
    return (
        log_multivariate_beta(prior)
        - log_multivariate_beta(concentration)
        + ((concentration - prior) * torch.digamma(concentration)).sum(-1)
        - (total - prior.sum(-1)) * torch.digamma(total)
    )


def max_dirichlet_entropy(categories: int) -> float:
    """Entropy of the uniform Dirichlet on the (K−1)-simplex: −log Γ(K), the largest possible."""
    return -math.lgamma(categories)


def normalised_certainty(concentration: Tensor) -> Tensor:
    """1 − exp(U − U_max) ∈ [0, 1): one minus the share of the simplex the posterior effectively
    covers (exp of an entropy is an effective volume). 0 for the uniform Dirichlet, → 1 as U → −∞."""
    categories = concentration.shape[-1]
    excess = dirichlet_entropy(concentration) - max_dirichlet_entropy(categories)
    return 1.0 - torch.exp(excess).clamp(max=1.0)


def categorical_entropy(probabilities: Tensor) -> Tensor:
    """−Σ p log p over the last axis (0 log 0 = 0)."""
    return -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1)
