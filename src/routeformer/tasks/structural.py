"""The toy regression tasks of "Attention as Implicit Structural Inference" (Singh & Buckley, 2023).

Both tasks hide a short causal chain of vectors among noise vectors and ask for a linear read-out
of the chain at its last node, which sits at the last position of the sequence.

- `chain_batch` (Figure 2, multi-hop): x1 = W_r x0 + ε, x2 = W_r x1 + ε with a low-rank W_r;
  x0, x1 and T - 3 noise vectors are shuffled over positions 0..T-2, x2 is at T-1, and the target
  is y = W_y (x1 + x0). Since W_r is low rank, x1 keeps only part of x0: the read-out needs x0
  itself. The paper wants x0 to be reachable from x2 only through x1 (two hops). A generic
  low-rank W_r does not give that: x2 = W_r² x0 + ..., so one hop from x2 can still match x0.
  `nilpotent=True` draws W_r with W_r² = 0 (W_r = U Vᵀ, U ⊥ V orthonormal), so
  x2 = W_r ε₁ + ε₂ carries no information about x0 at all; with it the premise holds exactly.
- `recency_batch` (Figure 3, expanding): x2 = W_r x1 + ε, y = W_y x1; x1 sits δ positions before
  x2 with δ ~ Geometric(p) on {1, 2, ...} (mean 1/p, clipped to the context), every other position
  holds noise. With a full-rank W_r this task needs no attention: x1 = W_r⁻¹(x2 - ε) is a linear
  function of the last node, so a model with its attention removed solves it.
- `keyed=True` (recency task): x1 = [a; b] (halves of the features); x2 = [Q a + ε; n] with Q
  orthogonal and n fresh N(0, I) noise, and y = W_y b. x2 only *keys* x1 (by a) and carries
  nothing about b, so y is independent of the last node: without attention the best prediction
  is 0. A model must find x1 by content (match Q a) and read its b half.

All vectors x0 and noise are N(0, I); ε ~ N(0, noise² I). Weights come from `StructuralWeights`
(seeded); batches from a `torch.Generator`, so a seed fixes every split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from routeformer.ops._checks import check_positive

# A run's held-out sequences: validation (chosen on) and test (measured once), each drawn from
# its own seed so that no training batch repeats them (see `held_out`).
TEST_SEQUENCES = 2048


@dataclass
class StructuralTask:
    length: int = 16  # T: nodes per sequence, the chain's last node at T - 1
    dim: int = 16  # d: feature dimension of every node
    rank: int = 4  # rank of W_r (chain task); the recency task uses a full-rank W_r when rank >= dim
    target_dim: int = 4  # dimension of y
    noise: float = 0.1  # std of the chain's additive noise ε
    recency: float = 8.0  # recency task: mean distance 1/p of x1 before x2
    # chain task: W_r² = 0, so x2 tells nothing about x0 (needs 2·rank <= dim; see the module doc)
    nilpotent: bool = False
    # recency task: x2 keys x1 by half its features, y reads the other half (see the module doc)
    keyed: bool = False

    def __post_init__(self) -> None:
        for name in ("length", "dim", "rank", "target_dim"):
            check_positive(name, getattr(self, name))
        if self.length < 3:
            raise ValueError(f"length must be >= 3 (x0, x1, x2); got {self.length}")
        if not self.noise >= 0:
            raise ValueError(f"noise must be >= 0; got {self.noise}")
        if not self.recency >= 1:
            raise ValueError(f"recency (mean distance 1/p) must be >= 1; got {self.recency}")
        if self.keyed and self.dim < 2:
            raise ValueError(f"keyed=True needs dim >= 2 (a key half and a value half); got {self.dim}")
        if self.nilpotent and 2 * self.rank > self.dim:
            raise ValueError(f"nilpotent=True needs 2 * rank <= dim (W_r's row and column spaces must be "
                             f"orthogonal); got rank={self.rank}, dim={self.dim}")


@dataclass
class StructuralWeights:
    relation: Tensor  # W_r [d, d], spectral norm 1
    readout: Tensor  # W_y [target_dim, d]

    @classmethod
    def sample(cls, task: StructuralTask, seed: int) -> StructuralWeights:
        gen = torch.Generator().manual_seed(seed)
        rank = min(task.rank, task.dim)
        if task.nilpotent:  # U Vᵀ with orthonormal U ⊥ V: every singular value 1 and W_r² = 0
            basis = torch.linalg.qr(torch.randn(task.dim, 2 * rank, generator=gen)).Q
            relation = basis[:, :rank] @ basis[:, rank:].T
        else:
            left = torch.randn(task.dim, rank, generator=gen)
            relation = left @ torch.randn(task.dim, rank, generator=gen).T
            relation = relation / torch.linalg.matrix_norm(relation, ord=2)
        readout = torch.randn(task.target_dim, task.dim, generator=gen) / task.dim ** 0.5
        if task.keyed:  # Q on the key half only; the read-out sees only the value half
            half = task.dim // 2
            relation = torch.zeros(task.dim, task.dim)
            relation[:half, :half] = torch.linalg.qr(torch.randn(half, half, generator=gen)).Q
            readout[:, :half] = 0.0
            readout = readout * (task.dim / (task.dim - half)) ** 0.5
        return cls(relation, readout)


def _step(task: StructuralTask, weights: StructuralWeights, previous: Tensor, gen: torch.Generator) -> Tensor:
    """x_{i+1} = g W_r x_i + ε with g = √(d / rank), so that the chain keeps roughly unit scale."""
    gain = 1.0 if task.keyed else (task.dim / min(task.rank, task.dim)) ** 0.5  # keyed: Q is orthogonal
    return gain * previous @ weights.relation.T + task.noise * torch.randn(previous.shape, generator=gen)


def chain_batch(
    task: StructuralTask, weights: StructuralWeights, batch: int, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """(x [B, T, d], y [B, target_dim], positions [B, 2] of x0 and x1) for the multi-hop task."""
    x = torch.randn(batch, task.length, task.dim, generator=gen)
    x0 = torch.randn(batch, task.dim, generator=gen)
    x1 = _step(task, weights, x0, gen)
    x2 = _step(task, weights, x1, gen)
    # Shuffle: x0 and x1 go to two distinct random slots of 0..T-2; noise fills the others.
    order = torch.rand(batch, task.length - 1, generator=gen).argsort(dim=1)
    positions = order[:, :2]
    rows = torch.arange(batch)
    x[:, -1] = x2
    x[rows, positions[:, 1]] = x1
    x[rows, positions[:, 0]] = x0
    y = (x0 + x1) @ weights.readout.T
    return x, y, positions


def recency_batch(
    task: StructuralTask, weights: StructuralWeights, batch: int, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """(x [B, T, d], y [B, target_dim], distance [B] of x1 before x2) for the expanding task."""
    x = torch.randn(batch, task.length, task.dim, generator=gen)
    p = 1.0 / task.recency
    # Geometric on {1, 2, ...}: 1 + floor(log U / log(1 - p)); p = 1 puts x1 right before x2.
    uniform = torch.rand(batch, generator=gen).clamp_min(1e-12)
    distance = torch.ones(batch, dtype=torch.long) if p >= 1 else 1 + torch.floor(
        torch.log(uniform) / torch.log1p(torch.tensor(-p))).long()
    distance = distance.clamp(max=task.length - 1)
    x1 = torch.randn(batch, task.dim, generator=gen)
    rows = torch.arange(batch)
    x[rows, task.length - 1 - distance] = x1
    last = _step(task, weights, x1, gen)
    if task.keyed:  # the value half of x2 is fresh noise, like any noise node's
        half = task.dim // 2
        last[:, half:] = torch.randn(batch, task.dim - half, generator=gen)
    x[:, -1] = last
    return x, x1 @ weights.readout.T, distance


def held_out(task: StructuralTask, make_batch, seed: int, split: str, sequences: int):
    """(x, y, extra) of the `split` ("validation" or "test") sequences of run `seed`."""
    if split not in ("validation", "test"):
        raise ValueError(f"split must be 'validation' or 'test'; got {split!r}")
    weights = StructuralWeights.sample(task, seed=1000 + seed)
    offset = 3000 if split == "validation" else 2000
    return make_batch(task, weights, sequences, torch.Generator().manual_seed(offset + seed))


def zero_prediction_mse(
    task: StructuralTask, make_batch, seed: int, sequences: int = TEST_SEQUENCES
) -> float:
    """Test MSE of always predicting 0 (the scale a model's test MSE should be read against)."""
    return float(held_out(task, make_batch, seed, "test", sequences)[1].square().mean())
