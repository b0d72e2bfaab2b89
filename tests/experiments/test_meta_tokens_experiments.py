"""The meta-tokens experiments at toy size: they run, share their runs, and report
what they measured (accuracies at 1x and 2x, chance and floors, parameters)."""

import json

import pytest

import routeformer.experiments.meta_tokens_recall as recall
from routeformer.experiments.registry import _EXPERIMENTS


def tiny(quick):
    return recall.Settings(("copying",), (0, 1), 2, (2,), validation_sequences=8, test_sequences=8)


def test_experiments_run_at_toy_size_and_share_their_runs(tmp_path, monkeypatch):
    # (the registry as filled by importing this module; list_experiments imports every module)
    assert {"meta-tokens-recall", "meta-tokens-ablations", "meta-tokens-finetune"} <= set(_EXPERIMENTS)
    monkeypatch.setattr(recall, "settings", tiny)
    reports = {}
    for name, run in (("recall", recall.run_recall), ("ablations", recall.run_ablations),
                      ("finetune", recall.run_finetune)):
        out = tmp_path / name
        out.mkdir()
        reports[name] = run(out, True).read_text()
    runs = sorted(p.stem for p in (tmp_path / "meta-tokens-runs" / "runs").glob("*.json"))
    # recall: 3 variants x 2 seeds; ablations adds keep, zero, parallel and zeroed pause (its skip
    # row is shared); finetune adds 2 pre-trainings and 2 fine-tuned variants x 2 seeds (its scratch
    # rows are shared).
    assert len(runs) == 6 + 8 + 2 + 4, runs
    assert "test 2×" in reports["recall"] and "shortcut floor" in reports["recall"]
    assert "zeroed" in reports["ablations"] and "pre-trained" in reports["finetune"]
    result = json.loads((tmp_path / "recall" / "result.json").read_text())["results"]["copying"]
    for label, stats in result.items():
        if label == "floors":
            assert 0 < stats["1x"]["chance"] <= stats["1x"]["floor"] <= 1
            continue
        assert len(stats["test_2x"]["values"]) == 2
        assert all(0 <= v <= 1 for v in stats["test_1x"]["values"] + stats["test_2x"]["values"])


def test_curriculum_trains_each_stage_and_tests_at_the_final_length(tmp_path):
    from dataclasses import replace

    from routeformer.experiments.recall_runs import RECALL_SCHEDULE, RecallRun, train_recall
    from routeformer.runner.setups import Stage

    run = RecallRun("copying", {"segments": 6, "segment_length": 2}, variant="plain",
                    schedule=replace(RECALL_SCHEDULE, steps=4), evals=2, validation_sequences=8,
                    test_sequences=8, curriculum=(Stage({"segments": 2}, replace(RECALL_SCHEDULE, steps=4)),))
    record = train_recall(run)
    assert [entry["stage"] for entry in record["validation_history"]] == [0, 0, 1, 1]
    plain_length = 6 * (2 + 2) + 2 + 2 - 1  # without the `_PAUSE_` columns
    assert record["seq_len_1x"] == plain_length and record["seq_len_2x"] == 12 * 4 + 3
    # the curriculum is part of the run's cache key, so a run without it is another run
    assert recall.run_key(run) != recall.run_key(replace(run, curriculum=()))
    with pytest.raises(ValueError, match="curriculum entries"):
        replace(run, curriculum=(({"segments": 2}, 4),))


def test_copying_takes_more_segments_than_there_are_segment_names():
    from routeformer.tasks import build_task

    task = build_task("copying", segments=128, segment_length=2)
    assert task.seq_len == 128 * 4 + 2 + 2 - 1
    with pytest.raises(ValueError, match="segments must be <= 32"):
        build_task("list_recall", segments=33, segment_length=2)


def test_recall_512_runs_at_toy_size(tmp_path):
    out = tmp_path / "recall-512"
    out.mkdir()
    report = recall.run_recall_long(out, True).read_text()
    assert "test 2×" in report and "shortcut floor" in report
    assert "meta-tokens-recall-512" in _EXPERIMENTS
