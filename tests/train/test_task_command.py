"""`routeformer train --task NAME`: any registered task trained through compare's run path, in a run
directory that resumes after an interruption to the same record as a run that never stopped."""

import json
import subprocess
import sys

import pytest

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.tasks import build_task
from routeformer.train.on_task import build_task_model, parameter_count
from routeformer.train.task_loop import training_checkpoints
from tests.train.runs import MQAR_RUN, count_train_batches

# 6 steps, evaluated (and checkpointed) after steps 2, 4 and 6


def _train(capsys, out, *extra):
    assert main([*MQAR_RUN, "--out", str(out), *extra]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return summary, json.loads((out / "record.json").read_text())


def test_mqar_run_writes_a_record_with_test_metrics(tmp_path, capsys):
    summary, record = _train(capsys, tmp_path / "run")
    assert [entry["step"] for entry in record["validation"]] == [2, 4, 6]
    assert record["train"]["schedule"]["steps"] == 6 and record["train"]["schedule"]["batch_size"] == 16
    assert record["train"]["eval_every"] == 2 and record["seed"] == 1 and record["mechanism"] == "full"
    task = build_task("mqar", **QUICK.tasks["mqar"].options)
    assert record["task"] == task.describe()
    assert record["parameters"] == parameter_count(build_task_model(task, "full", {}, QUICK.spec))
    assert 0.0 <= record["test"]["accuracy"] <= 1.0 and record["quality"] == record["test"]["accuracy"]
    assert record["test"]["loss"] > 0 and record["validation"][-1]["loss"] > 0
    assert record["resumed"] == []  # the training state is kept, so that the run may train on
    assert [path.name for path in training_checkpoints(tmp_path / "run", "record")] == [
        "record.train0.1.pt", "record.train0.pt"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["setup"]["schedule"]["steps"] == 6 and config["task_options"] == QUICK.tasks["mqar"].options
    assert summary["quality"] == record["quality"] and summary["steps"] == 6


def test_an_interrupted_run_resumes_to_the_record_of_one_that_never_stopped(tmp_path, capsys, monkeypatch):
    _, straight = _train(capsys, tmp_path / "straight")
    out = tmp_path / "interrupted"
    count_train_batches(monkeypatch, interrupt_at=5)  # killed in step 5: steps 1-4 are checkpointed
    assert main([*MQAR_RUN, "--out", str(out)]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    assert not (out / "record.json").exists() and (out / "record.train0.pt").is_file()

    calls = count_train_batches(monkeypatch)
    _, resumed = _train(capsys, out)
    assert len(calls) == 2  # steps 5 and 6 only: it continued, it did not restart
    assert resumed["resumed"] == ["resumed from record.train0.pt after step 4"]
    assert resumed["validation"] == straight["validation"]
    assert resumed["test"] == straight["test"] and resumed["quality"] == straight["quality"]
    assert [path.name for path in training_checkpoints(out, "record")] == [
        path.name for path in training_checkpoints(tmp_path / "straight", "record")]

    calls = count_train_batches(monkeypatch)
    _, again = _train(capsys, out)  # finished: read back, not trained again
    assert calls == [] and again == resumed


def test_a_task_without_seq_len_trains_and_tests(tmp_path, capsys):
    """copying (a recall task; its length follows from segments) is not in compare's budget."""
    assert main(["train", "--task", "copying", "--steps", "2", "--evals", "1", "--batch-size", "8",
                 "--option", "segments=4", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "record.json").read_text())
    task = build_task("copying", segments=4)
    assert record["task"] == task.describe() and record["task_options"] == {"segments": 4}
    assert record["parameters"] == parameter_count(build_task_model(task, "full", {}, QUICK.spec))
    assert [entry["step"] for entry in record["validation"]] == [2]
    assert 0.0 <= record["quality"] <= 1.0 and record["quality"] == record["test"]["accuracy"]


BAD_ARGUMENTS = [
    (["--task", "nope"], "argument --task: unknown task 'nope'; registered: ['code_lm', 'copying'"),
    (["--task", "mqar", "--mechanism", "nope"],
     "argument --mechanism: unknown mechanism 'nope'; registered: ["),
    (["--task", "mqar", "--mechanism", "meta_tokens"], "tasks that have them: ['code_lm', 'lm']"),
    (["--task", "mqar", "--steps", "0"], "argument --steps: must be an integer >= 1; got '0'"),
    (["--task", "mqar", "--steps", "x"], "argument --steps: must be an integer >= 1; got 'x'"),
    (["--task", "mqar", "--seq-len", "-4"], "argument --seq-len: must be an integer >= 1; got '-4'"),
    (["--task", "mqar", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    (["--task", "mqar", "--evals", "0"], "argument --evals: must be an integer >= 1"),
    (["--task", "mqar", "--lr", "0"], "argument --lr: must be a finite number > 0; got '0'"),
    (["--task", "mqar", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["--task", "copying", "--seq-len", "32"], "argument --seq-len: task 'copying' has no seq_len option"),
    (["--task", "mqar", "--option", "bogus=1"], "argument --option: expected KEY=VALUE with KEY an option"),
    (["--task", "mqar", "--option", "pairs=0"], "pairs"),
    (["--task", "mqar", "--bogus"], "unrecognized arguments: --bogus"),
    (["--task", "mqar", "--config", "tiny"], "argument --task: with --config the task is lm"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("routeformer: error: ") and "\n" not in err, err
    assert message in err and captured.out == ""
    assert not (tmp_path / "run" / "record.json").exists()


def test_a_directory_of_another_run_is_refused_with_the_differences(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main([*MQAR_RUN, "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
    _train(capsys, tmp_path / "run")
    assert main([*MQAR_RUN, "--out", str(tmp_path / "run"), "--lr", "0.01"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a finished run (setup.schedule.lr 0.003 -> 0.01)" in err and "\n" not in err
    assert main([*MQAR_RUN, "--out", str(tmp_path / "run"), "--seed", "5"]) == 2
    assert "holds a run of another config (key " in capsys.readouterr().err
    _, fresh = _train(capsys, tmp_path / "run", "--lr", "0.01", "--fresh")  # --fresh: starts over
    assert fresh["train"]["schedule"]["lr"] == 0.01 and fresh["resumed"] == []


def test_bad_input_in_a_subprocess_gives_no_traceback():
    argv = [sys.executable, "-m", "routeformer.cli", "train", "--task", "mqar", "--steps", "0"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "argument --steps" in result.stderr
