"""Task runs' AdamW betas and tied embeddings: `--betas B1 B2` and `--model.tie_embeddings true` train
with them and record them; at their defaults ((0.9, 0.999), a separate head) config.json and the
record read as they did before the options existed, so earlier run directories and checkpoints
resume; bad values are refused in one line (CLI) or by an error naming the argument (library)."""

import json

import pytest

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.runner.jobs import Job, job_config
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import ModelSpec, spec_dict
from routeformer.train.task_loop import (
    TASK_BETAS,
    TaskTrainConfig,
    train_config_dict,
)
from tests.train.runs import SMALL_MQAR_RUN as RUN


def test_defaults_leave_config_json_and_the_record_as_they_were(tmp_path):
    run = tmp_path / "default"
    assert main([*RUN, "--out", str(run)]) == 0
    config = json.loads((run / "config.json").read_text())
    record = json.loads((run / "record.json").read_text())
    assert "betas" not in config and "tie_embeddings" not in config["spec"]
    assert "betas" not in record["train"] and "tie_embeddings" not in record["model"]
    # the defaults stated explicitly are the same run: read back, not refused
    assert main([*RUN, "--betas", "0.9", "0.999", "--model.tie_embeddings", "false", "--out", str(run)]) == 0


def test_betas_and_tying_train_and_are_recorded(tmp_path, capsys):
    run = tmp_path / "tied"
    assert main([*RUN, "--betas", "0.8", "0.95", "--model.tie_embeddings", "true", "--out", str(run)]) == 0
    config = json.loads((run / "config.json").read_text())
    record = json.loads((run / "record.json").read_text())
    assert config["betas"] == [0.8, 0.95] and config["spec"]["tie_embeddings"] is True
    assert record["train"]["betas"] == [0.8, 0.95] and record["model"]["tie_embeddings"] is True
    model = load_run_model(run).model
    assert model.lm_head.weight is model.backbone.token_embedding.weight
    untied = tmp_path / "untied"
    assert main([*RUN, "--out", str(untied)]) == 0
    assert record["parameters"] < json.loads((untied / "record.json").read_text())["parameters"]

    capsys.readouterr()
    assert main([*RUN, "--betas", "0.9", "0.95", "--model.tie_embeddings", "true", "--out", str(run)]) == 2
    error = capsys.readouterr().err
    assert "holds a finished run (betas" in error and "only with more steps" in error


@pytest.mark.parametrize(("arguments", "named"), [
    (["--betas", "0.9", "1.0"], "--betas"), (["--betas", "0.9", "x"], "--betas"),
    (["--betas", "0.9"], "--betas"),
    (["--model.tie_embeddings", "maybe"], "--model.tie_embeddings")])
def test_bad_values_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, arguments, named):
    run = tmp_path / "run"
    assert main([*RUN, *arguments, "--out", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith(f"routeformer: error: argument {named}: ")
    assert not run.exists()


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 1.0), (-0.1, 0.9), "ab", None, (0.9, float("nan")),
                                   (True, 0.9)])
def test_the_library_refuses_bad_betas_naming_the_argument(betas):
    with pytest.raises(ValueError, match=r"betas: two numbers in \[0, 1\)"):
        TaskTrainConfig(betas=betas)
    setup = QUICK.tasks["mqar"]
    with pytest.raises(ValueError, match=r"betas: two numbers in \[0, 1\)"):
        Job("k", "mqar", setup.options, "full", {}, 0, setup, betas=betas)


def test_saved_forms_leave_the_defaults_out():
    assert TaskTrainConfig(betas=[0.9, 0.99]).betas == (0.9, 0.99)
    assert "betas" not in train_config_dict(TaskTrainConfig())
    assert train_config_dict(TaskTrainConfig(betas=(0.5, 0.9)))["betas"] == [0.5, 0.9]
    assert "tie_embeddings" not in spec_dict(ModelSpec())
    assert spec_dict(ModelSpec(tie_embeddings=True))["tie_embeddings"] is True
    with pytest.raises(TypeError, match="tie_embeddings: must be a bool"):
        ModelSpec(tie_embeddings="yes")
    setup = QUICK.tasks["mqar"]
    plain = job_config(Job("k", "mqar", setup.options, "full", {}, 0, setup))
    assert "betas" not in plain and "tie_embeddings" not in plain["spec"]
    assert TASK_BETAS == (0.9, 0.999)
