"""The Dirichlet closed forms match torch.distributions."""

import math

import torch
from torch.distributions import Dirichlet, kl_divergence

from routeformer.ops.dirichlet import (
    dirichlet_entropy,
    dirichlet_kl,
    log_multivariate_beta,
    max_dirichlet_entropy,
    normalised_certainty,
)


def concentrations(seed, shape=(5, 7, 3)):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen, dtype=torch.float64) * 5 + 0.01


def test_entropy_matches_torch():
    c = concentrations(0)
    torch.testing.assert_close(dirichlet_entropy(c), Dirichlet(c).entropy())


def test_kl_matches_torch_with_a_broadcast_prior():
    c = concentrations(1)
    prior = torch.tensor([0.01, 0.86, 0.71], dtype=torch.float64)
    expected = kl_divergence(Dirichlet(c), Dirichlet(prior.expand_as(c)))
    torch.testing.assert_close(dirichlet_kl(c, prior), expected)
    assert dirichlet_kl(prior, prior).abs().item() < 1e-12


def test_log_beta_and_the_entropy_maximum():
    c = torch.tensor([2.0, 3.0], dtype=torch.float64)
    # B(2, 3) = Γ(2)Γ(3)/Γ(5) = 2/24
    torch.testing.assert_close(log_multivariate_beta(c), torch.tensor(math.log(2 / 24), dtype=torch.float64))
    uniform = torch.ones(3, dtype=torch.float64)
    maximum = torch.tensor(max_dirichlet_entropy(3), dtype=torch.float64)
    torch.testing.assert_close(dirichlet_entropy(uniform), maximum)
    assert (dirichlet_entropy(concentrations(2)) <= max_dirichlet_entropy(3) + 1e-9).all()


def test_normalised_certainty_is_zero_for_uniform_and_grows_with_evidence():
    uniform = torch.ones(3, dtype=torch.float64)
    assert normalised_certainty(uniform).abs().item() < 1e-12
    values = [normalised_certainty(torch.tensor([s, s, 3 * s], dtype=torch.float64)).item()
              for s in (2, 8, 32)]
    assert 0 < values[0] < values[1] < values[2] < 1
