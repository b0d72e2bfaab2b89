"""The structural-inference toy tasks: the chain and recency structure the experiments rely on."""

import pytest
import torch

from routeformer.tasks.structural import StructuralTask, StructuralWeights, chain_batch, recency_batch


def test_chain_batch_hides_x0_x1_and_puts_x2_last():
    task = StructuralTask(length=12, dim=8, rank=2, target_dim=3, noise=0.0)
    weights = StructuralWeights.sample(task, seed=0)
    x, y, positions = chain_batch(task, weights, 64, torch.Generator().manual_seed(1))
    assert x.shape == (64, 12, 8) and y.shape == (64, 3) and positions.shape == (64, 2)
    assert bool((positions < 11).all()) and bool((positions[:, 0] != positions[:, 1]).all())
    rows = torch.arange(64)
    x0, x1 = x[rows, positions[:, 0]], x[rows, positions[:, 1]]
    gain = (8 / 2) ** 0.5
    # Without noise the chain is exact: x1 = g W_r x0, x2 = g W_r x1, y = W_y (x0 + x1).
    torch.testing.assert_close(x1, gain * x0 @ weights.relation.T)
    torch.testing.assert_close(x[:, -1], gain * x1 @ weights.relation.T)
    torch.testing.assert_close(y, (x0 + x1) @ weights.readout.T)
    assert torch.linalg.matrix_rank(weights.relation) == 2
    # The slots of x0 and x1 are spread over the sequence, not fixed.
    assert len(set(positions[:, 0].tolist())) > 5


def _cross_covariance_x2_x0(task: StructuralTask) -> float:
    weights = StructuralWeights.sample(task, seed=0)
    x, _, positions = chain_batch(task, weights, 20000, torch.Generator().manual_seed(4))
    x0 = x[torch.arange(x.shape[0]), positions[:, 0]]
    return float((x[:, -1].T @ x0 / x.shape[0]).abs().max())


def test_nilpotent_relation_hides_x0_from_x2():
    task = StructuralTask(length=8, dim=8, rank=4, noise=1.0, nilpotent=True)
    relation = StructuralWeights.sample(task, seed=0).relation
    assert torch.linalg.matrix_rank(relation) == 4
    torch.testing.assert_close(torch.linalg.svdvals(relation)[:4], torch.ones(4))
    torch.testing.assert_close(relation @ relation, torch.zeros(8, 8), atol=1e-6, rtol=0)
    # x2 = g W_r ε1 + ε2: no covariance with x0, where a generic low-rank W_r leaves W_r² x0 in x2.
    assert _cross_covariance_x2_x0(task) < 0.05
    assert _cross_covariance_x2_x0(StructuralTask(length=8, dim=8, rank=4, noise=1.0)) > 0.2


def test_recency_distance_is_geometric_with_mean_one_over_p():
    task = StructuralTask(length=512, dim=4, rank=4, target_dim=2, noise=0.0, recency=8.0)
    weights = StructuralWeights.sample(task, seed=0)
    x, y, distance = recency_batch(task, weights, 20000, torch.Generator().manual_seed(2))
    assert int(distance.min()) >= 1
    assert abs(distance.float().mean().item() - 8.0) < 0.3
    rows = torch.arange(20000)[:200]
    x1 = x[rows, 511 - distance[:200]]
    torch.testing.assert_close(y[:200], x1 @ weights.readout.T)
    torch.testing.assert_close(x[rows, -1], x1 @ weights.relation.T)  # full rank: gain 1


def test_batches_are_reproducible_from_the_generator_seed():
    task = StructuralTask()
    weights = StructuralWeights.sample(task, seed=3)
    first = chain_batch(task, weights, 4, torch.Generator().manual_seed(5))
    second = chain_batch(task, weights, 4, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("options,message", [
    ({"length": 2}, "length must be >= 3"),
    ({"dim": 0}, "dim must be a positive integer"),
    ({"recency": 0.5}, "recency"),
    ({"noise": -1.0}, "noise must be >= 0"),
    ({"dim": 8, "rank": 5, "nilpotent": True}, "nilpotent=True needs 2 \\* rank <= dim"),
])
def test_bad_task_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        StructuralTask(**options)


def _least_squares_mse(features, y) -> float:
    """Test MSE of the best affine predictor of y from `features` (fit on the first half)."""
    features = torch.cat([features, torch.ones(features.shape[0], 1)], dim=1)
    half = features.shape[0] // 2
    solution = torch.linalg.lstsq(features[:half], y[:half]).solution
    return float((features[half:] @ solution - y[half:]).square().mean())


def test_recency_plain_is_solvable_from_the_last_node_keyed_is_not():
    """The plain recency task is largely solved without attention (y is linear in x2 up to the noise
    W_r⁻¹ amplifies, W_r being full rank but ill-conditioned); the
    keyed one makes y independent of x2 — the best affine read-out of x2 is no better than 0 —
    while y is exact given x1."""
    plain = StructuralTask(length=16, dim=8, rank=8, noise=0.1, recency=4.0)
    weights = StructuralWeights.sample(plain, seed=0)
    x, y, _ = recency_batch(plain, weights, 8000, torch.Generator().manual_seed(1))
    assert _least_squares_mse(x[:, -1], y) < 0.5 * float(y.square().mean())  # W_r ill-conditioned: not 0
    keyed = StructuralTask(length=16, dim=8, rank=8, noise=0.1, recency=4.0, keyed=True)
    weights = StructuralWeights.sample(keyed, seed=0)
    x, y, distance = recency_batch(keyed, weights, 8000, torch.Generator().manual_seed(1))
    floor = float(y[4000:].square().mean())
    assert floor > 0.3
    assert _least_squares_mse(x[:, -1], y) > 0.98 * floor
    x1 = x[torch.arange(8000), 15 - distance]
    torch.testing.assert_close(y, x1 @ weights.readout.T)
    # x2 keys x1: its first half is Q a + ε with Q orthogonal.
    half = 4
    relation = weights.relation[:half, :half]
    torch.testing.assert_close(relation @ relation.T, torch.eye(half), atol=1e-5, rtol=0)
    residual = x[:, -1, :half] - x1[:, :half] @ relation.T
    assert abs(float(residual.std()) - 0.1) < 0.01
    with pytest.raises(ValueError, match="keyed=True needs dim >= 2"):
        StructuralTask(dim=1, rank=1, keyed=True)
