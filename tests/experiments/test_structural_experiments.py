"""The structural-inference experiments at toy size: the selection rule, the floors, and the
timing and update tables."""

import statistics

import pytest
import torch

from routeformer.experiments.registry import list_experiments
from routeformer.experiments.structural_multihop import chain_study, gap_closed
from routeformer.experiments.structural_recency import (
    distance_probabilities,
    position_only_floor,
    recency_study,
)
from routeformer.experiments.structural_update import update_table
from routeformer.tasks.structural import StructuralTask, StructuralWeights, recency_batch


def test_the_new_experiments_are_registered():
    names = set(list_experiments())
    assert {"structural-multihop", "structural-multihop-long", "structural-recency", "structural-speed",
            "structural-update"} <= names


def test_chain_study_picks_the_lr_on_validation_and_reports_test(tmp_path, monkeypatch):
    from routeformer.experiments import structural_runs

    monkeypatch.setattr(structural_runs, "VALIDATION_SEQUENCES", 64)
    monkeypatch.setattr(structural_runs, "TEST_SEQUENCES", 64)
    task = StructuralTask(length=6, dim=8, rank=2, target_dim=2, noise=1.0, nilpotent=True)
    study = chain_study(tmp_path, "toy", task, steps=6, seeds=[0, 1], lrs=[1e-3, 3e-2])
    for model in study["models"].values():
        validation = model["validation_by_lr"]
        assert model["lr"] == min(validation, key=validation.get)
        assert len(model["test"]) == 2 and model["parameters"] > 0
    names = ["self-attention x1", "self-attention x2", "multihop x1"]
    expected = [gap_closed(*(study["models"][name]["test"][seed] for name in names)) for seed in (0, 1)]
    assert study["gap_closed_per_seed"] == pytest.approx(expected)
    assert gap_closed(1.0, 0.5, 0.6) == pytest.approx(0.8)
    # A second call reads every run from the cache: same numbers.
    assert chain_study(tmp_path, "toy", task, steps=6, seeds=[0, 1], lrs=[1e-3, 3e-2]) == study


def test_position_only_floor_matches_the_best_fixed_mix():
    """The floor formula equals the MSE of the best content-blind mix c_δ = P(δ), measured."""
    task = StructuralTask(length=12, dim=8, rank=8, target_dim=3, noise=0.1, recency=3.0, keyed=True)
    probabilities = distance_probabilities(3.0, 12)
    assert len(probabilities) == 11 and sum(probabilities) == pytest.approx(1.0)
    weights = StructuralWeights.sample(task, seed=0)
    x, y, _ = recency_batch(task, weights, 20000, torch.Generator().manual_seed(2))
    mix = torch.tensor(probabilities).flip(0)  # positions 0..T-2 hold distances T-1..1
    prediction = torch.einsum("t,btd->bd", mix, x[:, :-1]) @ weights.readout.T
    measured = float((prediction - y).square().mean())
    floor = position_only_floor(float(y.square().mean()), 3.0, 12)
    assert measured == pytest.approx(floor, rel=0.05)
    assert floor < float(y.square().mean())


def test_recency_study_rows(tmp_path):
    rows = recency_study(tmp_path, length=12, dim=4, recencies=[3.0], seeds=[0], steps=4, test_sequences=16,
                         models=["none (attention removed)", "expanding"])
    assert [row["model"] for row in rows] == ["none (attention removed)", "expanding"]
    assert rows[0]["parameters"] < rows[1]["parameters"]
    assert rows[1]["last_query_window"] >= 1
    assert rows[0]["position_only_floor"] < rows[0]["zero_prediction_mse"]


def test_update_table_shows_both_updates():
    records = update_table(24, caps=[1, 4])
    assert {r["update"] for r in records} == {"paper", "mean_field"}
    # With one step allowed every query stops at the cap, whatever the update.
    assert all(r["stopped_by_cap"] == 1.0 for r in records if r["max_iters"] == 1)
    assert statistics.fmean(r["max_change_vs_uncapped"] for r in records if r["max_iters"] == 1) > 0
