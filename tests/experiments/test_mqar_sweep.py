"""The mqar-sweep experiment at toy size: the grid, the report, resume from the stored runs."""

import json

import pytest

from routeformer.runner import jobs


def test_mqar_sweep_runs_a_toy_grid_and_resumes(tmp_path, monkeypatch):
    from routeformer.experiments import mqar_sweep

    toy = {"lengths": (16,), "pairs": (2, 8), "widths": (8, 16), "seeds": 2, "steps": 1,
           "mechanisms": ("full", "local")}
    monkeypatch.setattr(mqar_sweep, "QUICK_GRID", toy)
    report = mqar_sweep.mqar_sweep(tmp_path, quick=True, workers=1)
    result = json.loads((tmp_path / "result.json").read_text())
    # pairs=8 needs T >= 32: skipped; 2 widths x 2 mechanisms remain, each with 2 seeds
    assert {(r["width"], r["mechanism"], r["seeds"]) for r in result["rows"]} == {
        (8, "full", 2), (16, "full", 2), (8, "local", 2), (16, "local", 2)}
    assert "| 16 | 2 | full | 8 |" in report.read_text()
    monkeypatch.setattr(jobs, "train_job", lambda job: pytest.fail("retrained"))
    mqar_sweep.mqar_sweep(tmp_path, quick=True, workers=1)
