"""Where a task run trains: inside `train.task_loop.training_on(device)` the model of every task run
is built on `device`, and `train_task` and `evaluate_on_task` move each batch there (the batches are
drawn on the CPU, so a run sees the same tokens on any device). `routeformer train --task NAME
--device cpu|cuda|auto`, `train --spec FILE --device ...` and an LM config's `train.device` choose
it; asking for CUDA on a machine without one is one line, exit 2, nothing written. The CUDA run
itself is checked against the CPU run where a GPU is present (skipped otherwise)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.runner.jobs import Job, job_config, train_job
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import ModelSpec
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import training_device, training_on

TINY = str(Path(__file__).resolve().parents[2] / "src" / "routeformer" / "configs" / "tiny.yaml")
SMALL = ["--steps", "4", "--evals", "2", "--batch-size", "8", "--model.dim", "16", "--model.depth", "1"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _job(**changes) -> Job:
    setup = replace(QUICK.tasks["mqar"], schedule=Schedule(steps=3, batch_size=8, lr=1e-3, warmup_steps=1),
                    evals=1, validation_sequences=8, test_sequences=8)
    return replace(Job("dev", "mqar", dict(setup.options), "full", {}, 0, setup,
                       ModelSpec(dim=16, depth=1, heads=2, positions="rotary")), **changes)


def test_the_training_device_is_the_blocks_and_the_cpu_outside():
    assert training_device() == torch.device("cpu")
    with training_on("cpu"):
        assert training_device() == torch.device("cpu")
        with training_on(torch.device("meta")):
            assert training_device() == torch.device("meta")
        assert training_device() == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^device: a torch device such as 'cpu' or 'cuda:0'; got 'gpu0'$"):
        with training_on("gpu0"):
            pass


def test_a_run_on_the_cpu_block_is_the_run_outside_it():
    keep = {}
    outside = train_job(_job(), log=lambda line: None, keep_model=lambda m: keep.setdefault("outside", m))
    with training_on("cpu"):
        inside = train_job(_job(), log=lambda line: None, keep_model=lambda m: keep.setdefault("inside", m))
    drop = ("train_seconds",)
    assert ({k: v for k, v in inside.items() if k not in drop}
            == {k: v for k, v in outside.items() if k not in drop})
    assert "device" not in inside  # a CPU record keeps its shape
    for name, tensor in keep["outside"].state_dict().items():
        assert torch.equal(tensor, keep["inside"].state_dict()[name]), name


@no_cuda
def test_device_auto_trains_on_the_cpu_without_cuda(tmp_path, capsys):
    plain, auto = tmp_path / "plain", tmp_path / "auto"
    assert main(["train", "--task", "mqar", *SMALL, "--out", str(plain)]) == 0
    assert main(["train", "--task", "mqar", *SMALL, "--device", "auto", "--out", str(auto)]) == 0
    capsys.readouterr()
    first, second = load_run_model(plain).model.state_dict(), load_run_model(auto).model.state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert "device" not in json.loads((auto / "record.json").read_text())


def _spec(tmp_path: Path) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(job_config(_job())))
    return str(path)


@no_cuda
@pytest.mark.parametrize("form", ["task", "spec", "config"])
def test_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path, capsys, form):
    run = tmp_path / "run"
    argv, named = {
        "task": (["--task", "mqar", *SMALL, "--device", "cuda"], "argument --device"),
        "spec": (["--spec", _spec(tmp_path), "--device", "cuda"], "argument --device"),
        "config": (["--task", "lm", "--config", TINY, "--train.device", "cuda"], "train.device"),
    }[form]
    assert main(["train", *argv, "--out", str(run)]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert error == f"routeformer: error: {named}: 'cuda' but no CUDA device is available; use cpu or auto"
    assert captured.out == "" and not run.exists()


@pytest.mark.parametrize("argv", [["--task", "mqar", "--device", "tpu"],
                                  ["--spec", "SPEC", "--device", "tpu"]], ids=["task", "spec"])
def test_a_device_that_is_not_cpu_cuda_or_auto_is_refused(tmp_path, capsys, argv):
    argv = [_spec(tmp_path) if value == "SPEC" else value for value in argv]
    assert main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert "argument --device" in error and "'tpu'" in error and "\n" not in error
    assert not (tmp_path / "run").exists()


@cuda
def test_a_task_run_on_cuda_tracks_the_cpu_run_and_its_checkpoint_reads_on_the_cpu(tmp_path, capsys):
    runs = {device: tmp_path / device for device in ("cpu", "cuda")}
    for device, run in runs.items():
        assert main(["train", "--task", "mqar", *SMALL, "--device", device, "--out", str(run)]) == 0
    capsys.readouterr()
    records = {device: json.loads((run / "record.json").read_text()) for device, run in runs.items()}
    assert records["cuda"]["device"] == "cuda:0" and "device" not in records["cpu"]
    for on_cpu, on_cuda in zip(records["cpu"]["validation"], records["cuda"]["validation"], strict=True):
        assert on_cuda["train_loss"] == pytest.approx(on_cpu["train_loss"], rel=1e-3)
    kept = load_run_model(runs["cuda"]).model  # written from the GPU, read on the CPU
    assert next(kept.parameters()).device.type == "cpu"
    assert main(["eval", str(runs["cuda"])]) == 0
