"""Resuming a run: from the newest intact checkpoint, with a changed config, or afresh."""

import json
import shutil

import pytest
import torch
import yaml

from routeformer.cli import main
from routeformer.train import train
from routeformer.train.checkpoint import checkpoint_files, load_checkpoint
from tests.train.runs import quick_config
from tests.train.test_checkpoint import damage
from tests.train.test_training import Crash, assert_same_parameters, stop_at


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 12-step run (checkpoints at steps 12 and 10), copied by the tests that change it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(quick_config(run), quiet=True)
    return run


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_bit_exactly(tmp_path, capsys):
    whole = train(quick_config(tmp_path / "whole"), quiet=True)
    with pytest.raises(Crash):  # checkpoints at steps 5 and 10; killed in step 11
        train(quick_config(tmp_path / "split"), after_step=stop_at(11, Crash()), quiet=True)
    damage(tmp_path / "split/checkpoint.pt", "overwritten")  # unpickles fine: only the checksum tells
    capsys.readouterr()
    resumed = train(quick_config(tmp_path / "split"))
    err = capsys.readouterr().err
    assert "checkpoint.pt' is corrupt or truncated" in err and "resuming at step 5" in err
    assert_same_parameters(whole.model, resumed.model)  # steps 6-12 replayed exactly
    assert resumed.final_eval == whole.final_eval


def test_no_intact_checkpoint_exits_2_with_one_line_per_file(finished_run, tmp_path, capsys):
    run = copy_of(finished_run, tmp_path)
    for path in checkpoint_files(run):
        damage(path, "overwritten")
    assert main(["train", "--config", "tiny", "--out_dir", str(run), "--steps", "12"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and "Traceback" not in "".join(lines)
    assert "checkpoint.pt' is corrupt" in lines[0] and "checkpoint.1.pt' is corrupt" in lines[1]
    assert lines[2].startswith("routeformer: error: no intact checkpoint in") and "--fresh" in lines[2]


def test_a_changed_model_is_refused_and_config_yaml_kept(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    before = (run / "config.yaml").read_text()
    with pytest.raises(ValueError) as caught:
        train(quick_config(run, "--model.dim", "64", "--model.depth", "3", "--model.attention_options",
                           "{full: {}}", "--steps", "20"), quiet=True)
    message = str(caught.value)
    assert "model.depth 2 -> 3, model.dim 32 -> 64" in message and "--fresh" in message
    assert "train.steps" not in message  # accepted changes are not what stops it
    assert (run / "config.yaml").read_text() == before and load_checkpoint(run)["step"] == 12


def test_a_longer_schedule_is_accepted_and_recorded(finished_run, tmp_path, capsys):
    run = copy_of(finished_run, tmp_path)
    capsys.readouterr()
    result = train(quick_config(run, "--steps", "16", "--lr", "1e-3", "--beta2", "0.95"))
    assert result.step == 16
    assert ("resuming with changed settings (recorded in metrics.jsonl): train.beta2 0.99 -> 0.95, "
            "train.lr 0.003 -> 0.001, train.steps 12 -> 16") in capsys.readouterr().err
    change = next(record for record in records(run) if "config_changes" in record)
    assert change == {"step": 12, "config_changes": {"train.beta2": [0.99, 0.95], "train.lr": [0.003, 0.001],
                                                     "train.steps": [12, 16]}}
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 16
    assert yaml.safe_load((run / "config.before-step12.yaml").read_text())["train"]["steps"] == 12
    saved = load_checkpoint(run)
    assert saved["step"] == 16 and saved["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_fresh_starts_over(finished_run, tmp_path, capsys):
    run = copy_of(finished_run, tmp_path)
    capsys.readouterr()
    result = train(quick_config(run, "--model.dim", "16", "--steps", "3", "--checkpoint_every", "100"),
                   resume=False)
    assert "removed 2 checkpoint(s) of the earlier run" in capsys.readouterr().err
    assert result.step == 3 and result.model.config.dim == 16
    assert [load_checkpoint(path)["step"] for path in checkpoint_files(run)] == [3]
    assert (run / "config.before-step0.yaml").exists()
    assert [r["step"] for r in records(run) if "loss" in r] == [2, 3]


def test_a_kept_checkpoint_count_of_three_survives_a_run(tmp_path):
    train(quick_config(tmp_path / "run", "--keep_checkpoints", "3", "--checkpoint_every", "3"), quiet=True)
    assert [load_checkpoint(p)["step"] for p in checkpoint_files(tmp_path / "run")] == [12, 9, 6]
    assert all(torch.isfinite(v).all() for v in load_checkpoint(tmp_path / "run")["model"].values())
