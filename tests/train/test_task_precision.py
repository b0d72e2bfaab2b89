"""Task runs' precision: `--precision bf16` trains the forward under bfloat16 autocast on the CPU and
records it; fp32, the default, leaves config.json as it was; fp16 (float16 autocast and a gradient
scaler) trains on CUDA only (checked where a GPU is present; refused in one line elsewhere); a bad
value is refused in one line (CLI) or by a ValueError naming the argument (library); a checkpoint
written before the field existed resumes."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.models.heads import TokenPredictor
from routeformer.runner.jobs import Job
from routeformer.train.checkpoint import load_checkpoint, save_checkpoint
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import (
    TASK_BETAS,
    TaskTrainConfig,
    resumable_training,
    train_task,
    training_checkpoints,
)
from tests.train.runs import SMALL_MQAR_RUN as RUN


def test_bf16_trains_under_autocast_evaluates_in_fp32_and_is_recorded(tmp_path, capsys, monkeypatch):
    forward, seen = TokenPredictor.forward, {True: set(), False: set()}

    def recording(self, *args, **kwargs):
        seen[self.training].add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TokenPredictor, "forward", recording)
    run = tmp_path / "bf16"
    assert main([*RUN, "--precision", "bf16", "--out", str(run)]) == 0
    assert seen[True] == {(True, torch.bfloat16)}  # every training forward
    assert {enabled for enabled, _ in seen[False]} == {False}  # evaluation and test: fp32
    record = json.loads((run / "record.json").read_text())
    assert record["train"]["precision"] == "bf16"
    assert json.loads((run / "config.json").read_text())["precision"] == "bf16"
    weights = load_checkpoint(run / "checkpoint.pt")["model"]
    assert all(value.dtype == torch.float32 for value in weights.values())  # weights stay fp32
    assert all(math.isfinite(entry["train_loss"] + entry["loss"]) for entry in record["validation"])
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == record["validation"][-1]["accuracy"]

    # The finished run asked for at fp32 with no more steps: refused, naming the difference.
    assert main([*RUN, "--out", str(run)]) == 2
    error = capsys.readouterr().err
    assert "holds a finished run (precision 'bf16' -> 'fp32')" in error and "only with more steps" in error


def test_fp32_is_the_default_and_config_json_leaves_it_out(tmp_path):
    run = tmp_path / "fp32"
    assert main([*RUN, "--out", str(run)]) == 0
    assert "precision" not in json.loads((run / "config.json").read_text())  # as earlier runs wrote it
    assert json.loads((run / "record.json").read_text())["train"]["precision"] == "fp32"
    assert main([*RUN, "--precision", "fp32", "--out", str(run)]) == 0  # the same run: read back


def test_a_bad_precision_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*RUN, "--precision", "fp16x", "--out", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("routeformer: error: argument --precision: ")
    assert "'fp16x'" in error and "fp32" in error and "bf16" in error
    assert not run.exists()


@pytest.mark.parametrize("precision", ["fp16x", "FP16", "", None])
def test_the_library_refuses_a_bad_precision_naming_the_argument(precision):
    with pytest.raises(ValueError, match=r"precision: one of \['fp32', 'bf16', 'fp16'\]; got "):
        TaskTrainConfig(precision=precision)
    setup = QUICK.tasks["mqar"]
    with pytest.raises(ValueError, match=r"precision: one of \['fp32', 'bf16', 'fp16'\]; got "):
        Job("k", "mqar", setup.options, "full", {}, 0, setup, precision=precision)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only off CUDA")
def test_fp16_off_cuda_is_refused_by_the_loop_and_in_one_line_by_the_command(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^train.precision='fp16' needs a CUDA device"):
        train_task(nn.Linear(4, 1), lambda size, generator: (torch.zeros(size, 4), torch.zeros(size, 1)),
                   lambda model: {}, TaskTrainConfig(precision="fp16"), forward=_forward)
    config = ["train", "--task", "lm", "--config", "tiny", "--train.precision", "fp16"]
    for argv, named in (([*RUN, "--precision", "fp16"], "argument --precision"),
                        ([*RUN, "--precision", "fp16", "--device", "auto"], "argument --precision"),
                        (config, "train.precision")):
        run = tmp_path / "run"
        assert main([*argv, "--out", str(run)]) == 2
        error = capsys.readouterr().err.strip()
        assert error == (f"routeformer: error: {named}: 'fp16' needs a CUDA device (float16 autocast "
                         "with a gradient scaler); on cpu use bf16")
        assert not run.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_fp16_task_run_on_cuda_trains_and_is_recorded(tmp_path, capsys):
    run = tmp_path / "fp16"
    assert main([*RUN, "--precision", "fp16", "--device", "cuda", "--out", str(run)]) == 0
    record = json.loads((run / "record.json").read_text())
    assert record["train"]["precision"] == "fp16" and record["device"] == "cuda:0"
    assert all(math.isfinite(entry["train_loss"]) for entry in record["validation"])
    assert json.loads((run / "config.json").read_text())["precision"] == "fp16"


def _forward(model, inputs, labels):
    loss = (model(inputs) - labels).pow(2).mean()
    return SimpleNamespace(total_loss=loss, loss=loss, aux_loss=torch.zeros(()))


def _train(directory, stop_at: int | None = None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 1))
    calls = []

    def make_batch(batch_size, generator):
        calls.append(None)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        inputs = torch.randn(batch_size, 4, generator=generator)
        return inputs, inputs.sum(dim=1, keepdim=True).sin()

    config = TaskTrainConfig(Schedule(steps=5, batch_size=8, lr=1e-2, warmup_steps=1), eval_every=2, seed=4)
    with resumable_training(directory, "run"):
        history = train_task(model, make_batch, lambda m: {}, config, forward=_forward)
    return model, history


@pytest.mark.parametrize("field, default", [("precision", "fp32"), ("betas", TASK_BETAS)])
def test_a_checkpoint_without_a_later_field_resumes_with_its_default(tmp_path, field, default):
    straight, straight_history = _train(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "old", stop_at=4)  # stopped in step 4, after the step-2 checkpoint
    path, = training_checkpoints(tmp_path / "old", "run")
    state = load_checkpoint(path)
    value = state["config"].pop(field)
    assert (tuple(value) if field == "betas" else value) == default
    save_checkpoint(path, state)  # as a checkpoint of a task run before the field existed
    resumed, history = _train(tmp_path / "old")
    assert history.evals == straight_history.evals
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
