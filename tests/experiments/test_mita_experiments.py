"""mita-listops on the shared ListOps task at its --quick size (a few seconds idle)."""

import json

import pytest

from routeformer.experiments.mita_tasks import budget_grid, listops


def test_budget_grid_varies_one_axis_around_the_trained_budget():
    grid = budget_grid(128)
    assert (16, 16) in grid and len(grid) == len(set(grid))
    assert {m for m, k in grid if k == 16} == {4, 8, 16, 32, 64}
    assert {k for m, k in grid if m == 16} == {4, 8, 16, 32, 64}


def test_quick_run_reports_floor_budget_grid_and_swaps(tmp_path):
    report = listops(tmp_path, quick=True).read_text()
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["summary"]) == {"full", "linear", "local", "mita"}
    assert "Shortcut rules" in report and "Fig. 7" in report and "Fig. 8" in report
    mita_run = result["runs"]["mita"][0]
    assert set(mita_run["budget_grid"]) == {f"{m},{k}" for m, k in budget_grid(32)}
    # evaluated at its own budget, the grid reproduces the run's own test accuracy
    assert mita_run["budget_grid"]["4,4"]["test"] == pytest.approx(mita_run["quality"])
    assert mita_run["swapped"]["evaluated_with"] == "full"
    assert result["runs"]["full"][0]["swapped"]["evaluated_with"] == "mita"
    assert set(result["trained_at"]) == {"m=k=2", "m=k=8"}
