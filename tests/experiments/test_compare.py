"""`routeformer compare` at toy size: selection errors, the Pareto front, a full run, resume."""

import json

import pytest

from routeformer.cli import main
from routeformer.experiments import compare
from routeformer.experiments.compare import CompareBudget, check_selection, pareto_front, run_compare

TOY = CompareBudget("toy", lm_steps=2, mqar_steps=2, listops_steps=2, batch_size=2, mqar_test_sequences=64,
                    listops_lengths=(20, 40), listops_examples=(16, 8), bench_lengths=(64,), repeats=1)


def test_selection_is_checked_against_the_registry():
    mechanisms, tasks = check_selection(None, None)
    assert mechanisms[0] == "full" and {"topk", "meta", "meta_tokens"} <= set(mechanisms)
    assert tasks == ["lm", "mqar", "listops"]
    with pytest.raises(ValueError, match=r"mechanisms: unknown \['nope'\]; registered: "):
        check_selection(["full", "nope"], None)
    with pytest.raises(ValueError, match=r"tasks: unknown \['vision'\]; valid: \['lm', 'mqar', 'listops'\]"):
        check_selection(None, ["vision"])


def test_pareto_front():
    # name: (flops, quality). Lower is better (bits/char): a dominates b (fewer FLOPs, lower bits);
    # c and e tie, and a tie dominates neither.
    points = {"a": (1.0, 2.0), "b": (2.0, 2.5), "c": (3.0, 1.5), "d": (0.5, 3.0), "e": (3.0, 1.5)}
    assert pareto_front(points, higher_is_better=False) == {"a", "c", "d", "e"}
    # Higher is better (accuracy): d is both the cheapest and the best, so it dominates every other.
    assert pareto_front(points, higher_is_better=True) == {"d"}


def test_toy_compare_writes_the_report_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "compare"
    report = run_compare(out, mechanisms=["full", "local", "meta_tokens"], budget=TOY)
    result = json.loads((out / "result.json").read_text())
    assert set(result["tasks"]) == {"lm", "mqar", "listops"}
    lm = {row["mechanism"]: row for row in result["tasks"]["lm"]}
    assert set(lm) == {"full", "local", "meta_tokens"}  # meta_tokens only on the LM
    assert {row["mechanism"] for row in result["tasks"]["mqar"]} == {"full", "local"}
    assert lm["full"]["flops_vs_full"] == 1.0 and 0 < lm["local"]["flops_vs_full"] < 1  # window T/4
    for row in lm.values():
        assert row["quality"] > 0 and row["train_step_ms"] > 0 and row["inference_ms"] > 0
    assert {(row["T"], row["mechanism"]) for row in result["bench"]} == {(64, "full"), (64, "local"),
                                                                           (64, "meta_tokens")}
    text = report.read_text()
    assert "## lm" in text and "## mqar" in text and "## listops" in text and "vs full" in text

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished (task, mechanism) was run again")

    monkeypatch.setattr(compare, "_run_job", must_not_run)
    monkeypatch.setattr(compare, "bench_layers", must_not_run)
    run_compare(out, mechanisms=["full", "local", "meta_tokens"], budget=TOY)  # all cached


def test_compare_cli_rejects_unknown_mechanisms(tmp_path, capsys):
    assert main(["compare", "--mechanisms", "nope", "--out", str(tmp_path)]) == 2
    assert "mechanisms: unknown ['nope']" in capsys.readouterr().err
