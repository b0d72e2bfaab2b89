"""topk-routing-learning: the grid it trains, how it chooses on validation, and a --quick smoke run."""

import json

import pytest
import torch

from routeformer.experiments import topk_routing_learning as trl
from routeformer.experiments.registry import list_experiments


def test_registered():
    assert "topk-routing-learning" in list_experiments()


def test_grid_sets_every_option_explicitly():
    grid = trl.variants(128)
    assert grid["full"] == ("full", {})
    topk = {name: options for name, (mechanism, options) in grid.items() if mechanism == "topk"}
    pairs = {(o["routing_learning"], o["routing_positions"]) for o in topk.values()}
    # every learning option under the recency router, and distill under the position-blind one
    assert pairs == {("distill", "recency"), ("score_bias", "recency"), ("none", "recency"),
                     ("distill", "none")}
    assert all(o["topk"] == 16 for o in topk.values())  # K = T/8


def test_jobs_have_unique_keys_and_same_backbone():
    setups, seeds, spec = trl.plan(quick=False)
    jobs = trl.jobs_for(setups, seeds, spec)
    assert len(jobs) == 5 * (len(seeds["mqar"]) + len(seeds["lm"]))
    assert len({job.key for job in jobs}) == len(jobs)
    assert min(len(s) for s in seeds.values()) >= 3
    assert {job.spec for job in jobs} == {spec}


def _row(validation, seeds=3):
    return {"validation_mean_sd": validation, "seeds": list(range(seeds))}


def test_choose_picks_on_validation_and_reports_separation():
    rows = {
        "full": _row((0.99, 0.0)),  # never a candidate
        "topk distill, positions=recency": _row((0.90, 0.01)),
        "topk score_bias, positions=recency": _row((0.89, 0.01)),  # within 3 sd of distill
        "topk none, positions=recency": _row((0.50, 0.02)),  # clearly worse
        "topk none, positions=none": _row((0.95, 0.0)),  # other positions: not compared here
    }
    choice = trl.choose(rows, higher=True, vary="routing_learning", fixed="positions=recency")
    assert choice["best_on_validation"] == "topk distill, positions=recency"
    assert choice["separated_from"] == ["topk none, positions=recency"]
    assert choice["not_separated_from"] == ["topk score_bias, positions=recency"]
    lower = trl.choose(rows, higher=False, vary="routing_learning", fixed="positions=recency")
    assert lower["best_on_validation"] == "topk none, positions=recency"


def test_summarise_uses_last_validation_and_test():
    records = [{"seed": s, "parameters": 10, "validation": [{"accuracy": 0.0}, {"accuracy": v}],
                "test": {"accuracy": t, "attention_flops_per_token": 5.0}}
               for s, v, t in [(0, 0.5, 0.4), (1, 0.7, 0.6)]]
    summary = trl.summarise(records, "accuracy")
    assert summary["validation"] == [0.5, 0.7] and summary["test"] == [0.4, 0.6]
    assert summary["validation_mean_sd"][0] == pytest.approx(0.6)
    assert summary["test_mean_sd"][1] == pytest.approx(0.1414, abs=1e-4)


def test_quick_run_writes_report(tmp_path):
    torch.set_num_threads(1)
    report = trl.routing_learning(tmp_path, quick=True)
    text = report.read_text()
    assert "topk distill, positions=recency" in text and "Choice on validation" in text
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["tasks"]) == {"mqar", "lm"}
    for task in result["tasks"].values():
        rows = task["variants"]
        assert len(rows) == 5
        # a frozen random router ("none", its recency slope too) holds no parameters; a learned one does
        assert rows["topk none, positions=recency"]["parameters"] == rows["full"]["parameters"]
        assert rows["topk distill, positions=none"]["parameters"] > rows["full"]["parameters"]
        assert rows["topk distill, positions=recency"]["parameters"] > rows["topk distill, positions=none"][
            "parameters"]  # the learned recency slope
        assert len(task["choices"]) == 2
    # a second call reads the stored runs instead of training again
    assert trl.routing_learning(tmp_path, quick=True).read_text().count("| topk") == 8
