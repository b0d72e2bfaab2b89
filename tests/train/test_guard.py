"""The non-finite guard: a NaN step is skipped with a warning; N in a row stop the run."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from routeformer.models.heads import TokenPredictor
from routeformer.train import train
from routeformer.train.checkpoint import load_checkpoint
from routeformer.train.guard import NonFiniteGuard, TrainingDiverged
from tests.train.runs import quick_config


def test_the_guard_skips_non_finite_steps_and_stops_after_the_limit():
    warnings = []
    guard = NonFiniteGuard(3, warn=lambda step, message: warnings.append(message))
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    assert guard.allows(1, one, one)
    assert not guard.allows(2, nan, one) and not guard.allows(3, one, torch.tensor(float("inf")))
    assert guard.allows(4, one, one)  # a good step resets the count in a row
    assert not guard.allows(5, nan, nan) and not guard.allows(6, nan, nan)
    with pytest.raises(TrainingDiverged, match="3 consecutive steps with a non-finite loss or gradient"):
        guard.allows(7, nan, nan)
    assert guard.skipped == 5 and len(warnings) == 4 and "step 2: non-finite loss nan" in warnings[0]


def inject_nan_loss(monkeypatch, bad_calls):
    """Make the training forward calls numbered in `bad_calls` (1-based) return a NaN loss."""
    forward, calls = TokenPredictor.forward, [0]

    def poisoned(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if self.training:
            calls[0] += 1
            if calls[0] in bad_calls:
                return dataclasses.replace(output, loss=output.loss * float("nan"))
        return output

    monkeypatch.setattr(TokenPredictor, "forward", poisoned)


def test_a_nan_step_is_skipped_and_the_run_finishes(tmp_path, monkeypatch, capsys):
    inject_nan_loss(monkeypatch, {4})
    result = train(quick_config(tmp_path / "run"), quiet=True)
    # Even a quiet run says so: one line on stderr.
    assert capsys.readouterr().err.startswith("routeformer: warning: step 4: non-finite loss nan")
    assert result.skipped_steps == 1 and result.step == 12
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if "skipped" in r]
    assert [r["step"] for r in skipped] == [4] and "update skipped" in skipped[0]["skipped"]
    assert all(record.get("loss", 0) == record.get("loss", 0) for record in records)  # no NaN logged


def test_a_run_that_keeps_producing_nan_stops_with_a_clear_error(tmp_path, monkeypatch):
    inject_nan_loss(monkeypatch, set(range(7, 100)))
    config = quick_config(tmp_path / "run", "--max_nonfinite_steps", "3")
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps .*\(step 9: loss nan"):
        train(config, quiet=True)
    saved = load_checkpoint(tmp_path / "run/record.train0.pt")  # the last: before the trouble, finite
    assert saved["step"] == 6
    assert all(torch.isfinite(value).all() for value in saved["model"].values() if value.is_floating_point())


def test_a_task_run_stops_after_its_own_limit_of_non_finite_steps():
    from routeformer.train.task_loop import TaskTrainConfig, train_task

    def forward(model, inputs, labels):
        loss = (model(inputs) - labels).pow(2).mean() * float("nan")
        return SimpleNamespace(total_loss=loss, loss=loss, aux_loss=torch.zeros(()))

    def batch(size, generator):
        return torch.zeros(size, 4), torch.zeros(size, 1)

    config = TaskTrainConfig(max_nonfinite_steps=2)
    with pytest.raises(TrainingDiverged, match=r"^training diverged: 2 consecutive steps with a non-finite"):
        train_task(torch.nn.Linear(4, 1), batch, lambda model: {}, config, forward=forward)
    with pytest.raises(ValueError, match=r"^max_nonfinite_steps: a positive integer"):
        TaskTrainConfig(max_nonfinite_steps=0)
