"""Resuming an LM run (`routeformer.train.train`, the task-lm run of its config): from the newest
intact checkpoint, with a changed schedule, or afresh."""

import json
import shutil

import pytest
import torch

from routeformer.train import train
from routeformer.train.checkpoint import checkpoint_files, load_checkpoint
from tests.train.runs import quick_config
from tests.train.test_checkpoint import damage
from tests.train.test_training import Crash, assert_same_parameters, stop_at_batch

TRAINING = "record.train0"  # the stem of an LM run directory's training checkpoints


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 12-step run (training checkpoints at steps 12 and 10), copied by the tests that
    change it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(quick_config(run), quiet=True)
    return run


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def _stopped_in_step_11(tmp_path, monkeypatch):
    """A run killed in step 11: checkpoints after steps 10 (checkpoint_every 5) and 6 (its first
    evaluation)."""
    stop_at_batch(monkeypatch, 11, Crash())
    with pytest.raises(Crash):
        train(quick_config(tmp_path / "split"), quiet=True)
    monkeypatch.undo()
    assert [load_checkpoint(p)["step"] for p in checkpoint_files(tmp_path / "split", TRAINING)] == [10, 6]
    return tmp_path / "split"


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_bit_exactly(tmp_path, capsys, monkeypatch):
    whole = train(quick_config(tmp_path / "whole"), quiet=True)
    split = _stopped_in_step_11(tmp_path, monkeypatch)
    damage(split / f"{TRAINING}.pt", "overwritten")  # unpickles fine: only the checksum tells
    capsys.readouterr()
    resumed = train(quick_config(split))
    err = capsys.readouterr().err
    assert f"{TRAINING}.pt' is corrupt or truncated" in err and f"resuming from {TRAINING}.1.pt" in err
    assert resumed.record["resumed"] == [f"resumed from {TRAINING}.1.pt after step 6"]
    assert_same_parameters(whole.model, resumed.model)  # steps 7-12 replayed exactly
    assert resumed.final_eval == whole.final_eval


def test_no_intact_checkpoint_refuses_to_start_over(tmp_path, monkeypatch):
    split = _stopped_in_step_11(tmp_path, monkeypatch)
    for path in checkpoint_files(split, TRAINING):
        damage(path, "overwritten")
    before = {path.name: path.read_bytes() for path in split.iterdir()}
    with pytest.raises(ValueError, match="holds metrics.jsonl of an earlier run .* none intact.*--fresh"):
        train(quick_config(split), quiet=True)
    assert {path.name: path.read_bytes() for path in split.iterdir()} == before


def test_a_changed_model_is_refused_and_config_json_kept(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    before = (run / "config.json").read_text()
    with pytest.raises(ValueError) as caught:
        train(quick_config(run, "--model.dim", "64", "--model.depth", "3", "--steps", "20"), quiet=True)
    message = str(caught.value)
    assert "holds a run of another config" in message and "--fresh" in message
    assert "spec.depth 2 -> 3, spec.dim 32 -> 64" in message
    assert (run / "config.json").read_text() == before and load_checkpoint(run)["step"] == 12


def test_a_longer_schedule_is_accepted_and_recorded(finished_run, tmp_path, capsys):
    run = copy_of(finished_run, tmp_path)
    capsys.readouterr()
    result = train(quick_config(run, "--steps", "16", "--lr", "1e-3", "--beta2", "0.95"))
    assert result.step == 16 and [entry["step"] for entry in result.record["validation"]] == [6, 12, 16]
    changes = {"betas": [[0.9, 0.99], [0.9, 0.95]], "setup.eval_every": [None, 6],
               "setup.schedule.lr": [0.003, 0.001], "setup.schedule.steps": [12, 16]}
    assert ("the run continues on a changed schedule: betas [0.9, 0.99] -> [0.9, 0.95], setup.eval_every "
            "None -> 6, setup.schedule.lr 0.003 -> 0.001, setup.schedule.steps 12 -> 16"
            ) in capsys.readouterr().err
    assert next(record for record in records(run) if "config_changes" in record) == {
        "step": 12, "config_changes": changes}
    assert json.loads((run / "config.json").read_text())["setup"]["schedule"]["steps"] == 16
    assert json.loads((run / "config.before-step12.json").read_text())["setup"]["schedule"]["steps"] == 12
    assert json.loads((run / "record.before-step12.json").read_text())["validation"][-1]["step"] == 12
    saved = load_checkpoint(run / f"{TRAINING}.pt")
    assert saved["step"] == 16 and load_checkpoint(run)["step"] == 16
    assert saved["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # the optimizer took them
    with pytest.raises(ValueError, match="holds a run of another config .*seed"):  # not the schedule
        train(quick_config(run, "--steps", "16", "--lr", "1e-3", "--beta2", "0.95", "--seed", "1"),
              quiet=True)


def test_an_interrupted_run_may_resume_under_another_precision_and_weight_decay(tmp_path, monkeypatch):
    split = _stopped_in_step_11(tmp_path, monkeypatch)
    result = train(quick_config(split, "--precision", "bf16", "--weight_decay", "0.01"), quiet=True)
    assert result.record["resumed"] == [f"resumed from {TRAINING}.pt after step 10"]
    assert result.record["train"]["precision"] == "bf16" and result.record["train"]["weight_decay"] == 0.01
    decay = load_checkpoint(split / f"{TRAINING}.pt")["optimizer"]["param_groups"][0]["weight_decay"]
    assert decay == 0.01


def test_fresh_starts_over(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    result = train(quick_config(run, "--model.dim", "16", "--steps", "3", "--checkpoint_every", "100"),
                   resume=False, quiet=True)
    assert result.step == 3 and result.model.config.dim == 16
    assert [load_checkpoint(path)["step"] for path in checkpoint_files(run, TRAINING)] == [3]
    assert not list(run.glob("*.before-step*"))
    assert [r["step"] for r in records(run) if "lr" in r] == [2, 3]


def test_a_kept_checkpoint_count_of_three_survives_a_run(tmp_path):
    train(quick_config(tmp_path / "run", "--keep_checkpoints", "3", "--checkpoint_every", "3"), quiet=True)
    kept = checkpoint_files(tmp_path / "run", TRAINING)
    assert [load_checkpoint(p)["step"] for p in kept] == [12, 9, 6]
    assert all(torch.isfinite(v).all() for v in load_checkpoint(kept[0])["model"].values())
