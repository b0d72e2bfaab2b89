"""A task run directory keeps metrics.jsonl while it trains: a line per evaluation (the LM run's
keys: step, train_loss, aux_loss, val_*; a staged run's stage), with log_every a training line every
that many updates, and a final line with the test, one line per step however often the run was
interrupted (checkpoint_every: also between evaluations); runs outside a run directory write none."""

import json
from dataclasses import replace

import pytest

from routeformer.cli import main
from routeformer.compare.budgets import Stage, curriculum_setup
from routeformer.runner import run_dir
from routeformer.runner.jobs import Job, TaskSetup, run_jobs, train_job
from routeformer.runner.run_dir import METRICS_FILE, run_in_directory
from routeformer.train.checkpoint import load_checkpoint
from routeformer.train.on_task import ModelSpec
from routeformer.train.progress import read_records
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import training_checkpoints
from tests.train.runs import MQAR_RUN, count_train_batches, hide_tensorboard

# 6 steps, evaluated (and checkpointed) after steps 2, 4 and 6
TOY = Schedule(steps=4, batch_size=4, lr=1e-3, warmup_steps=1)
MQAR_OPTIONS = {"seq_len": 16, "pairs": 2, "vocab_size": 16}


def _job(setup=None) -> Job:
    setup = setup or TaskSetup(options={}, schedule=TOY, evals=2, validation_sequences=8, test_sequences=8)
    return Job(key="mqar-full-s0", task="mqar", task_options=MQAR_OPTIONS, mechanism="full", options={},
               seed=0, setup=setup)


def _train(capsys, out, *extra):
    assert main([*MQAR_RUN, "--out", str(out), *extra]) == 0
    capsys.readouterr()
    return read_records(out / METRICS_FILE), json.loads((out / "record.json").read_text())


def test_a_task_run_has_a_line_per_evaluation_and_a_final_line(tmp_path, capsys):
    lines, record = _train(capsys, tmp_path / "run")
    *evaluations, final = lines
    assert [line["step"] for line in evaluations] == [2, 4, 6]
    for line, entry in zip(evaluations, record["validation"], strict=True):
        assert list(line)[:3] == ["step", "train_loss", "aux_loss"]
        losses = ("step", "train_loss", "aux_loss")
        assert line == {**{key: entry[key] for key in losses},
                        **{f"val_{key}": value for key, value in entry.items() if key not in losses}}
        assert {"val_loss", "val_accuracy"} <= set(line)
    assert final == {"step": 6, "final": True,
                     **{f"test_{key}": value for key, value in record["test"].items()}}
    assert final["test_accuracy"] == record["quality"]


def test_an_interrupted_run_resumed_has_each_step_once(tmp_path, capsys, monkeypatch):
    straight, _ = _train(capsys, tmp_path / "straight")
    out = tmp_path / "interrupted"
    # stopped in step 5: evaluations 2 and 4 are checkpointed
    count_train_batches(monkeypatch, interrupt_at=5)
    assert main([*MQAR_RUN, "--out", str(out)]) == 130
    capsys.readouterr()
    assert [line["step"] for line in read_records(out / METRICS_FILE)] == [2, 4]
    with (out / METRICS_FILE).open("a") as handle:  # as if killed after a line, before its checkpoint
        handle.write(json.dumps({**straight[2], "train_loss": -1.0}) + "\n")
    calls = count_train_batches(monkeypatch, interrupt_at=None)
    resumed, record = _train(capsys, out)
    assert len(calls) == 2 and record["resumed"] == ["resumed from record.train0.pt after step 4"]
    assert resumed == straight  # the same lines, each step once

    _train(capsys, out)  # finished: read back, the file left as it is
    assert read_records(out / METRICS_FILE) == straight


def test_a_run_stopped_between_its_final_line_and_its_record_writes_one_final_line(tmp_path, capsys,
                                                                                     monkeypatch):
    straight, _ = _train(capsys, tmp_path / "straight")
    out, final = tmp_path / "stopped", run_dir._TaskMetrics.final

    def final_then_stop(self, step, test):
        final(self, step, test)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_dir._TaskMetrics, "final", final_then_stop)
    assert main([*MQAR_RUN, "--out", str(out)]) == 130
    capsys.readouterr()
    assert not (out / "record.json").exists() and training_checkpoints(out, "record")
    monkeypatch.setattr(run_dir._TaskMetrics, "final", final)
    lines, _ = _train(capsys, out)  # resumes as finished: tested again, no second final line
    assert lines == straight


def test_fresh_starts_the_file_over(tmp_path, capsys):
    first, _ = _train(capsys, tmp_path / "run")
    again, _ = _train(capsys, tmp_path / "run", "--fresh")
    assert [line["step"] for line in again] == [line["step"] for line in first] == [2, 4, 6, 6]


def _staged_job() -> Job:
    """Two stages (T=16 for 2 steps, then T=32 for 3), each evaluated at its end; tested at 32, 64, 128."""
    toy = replace(TOY, steps=2)
    setup = curriculum_setup({"seq_len": 32, "pairs": 4, "vocab_size": 16},
                             (Stage({"seq_len": 16, "pairs": 2}, toy), Stage({}, replace(toy, steps=3))),
                             evals=1, validation_sequences=8, test_tokens=256)
    return replace(_job(setup), task_options=dict(setup.options), spec=ModelSpec(positions="rotary"))


def test_a_staged_run_counts_steps_over_its_stages_and_names_the_stage(tmp_path):
    record = run_in_directory(tmp_path / "staged", _staged_job(), log=lambda line: None)
    *evaluations, final = read_records(tmp_path / "staged" / METRICS_FILE)
    assert [(line["step"], line["stage"]) for line in evaluations] == [(2, 0), (5, 1)]
    assert [line["val_accuracy"] for line in evaluations] == [e["accuracy"] for e in record["validation"]]
    assert final == {"step": 5, "final": True,
                     **{f"test_{key}": value for key, value in record["tests"]["32"].items()}}


def test_a_staged_run_interrupted_in_its_second_stage_has_each_step_once(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    run_in_directory(straight, _staged_job(), log=lambda line: None)
    out = tmp_path / "interrupted"
    # inside the second step of the second stage: before its checkpoint
    count_train_batches(monkeypatch, interrupt_at=4)
    with pytest.raises(KeyboardInterrupt):
        run_in_directory(out, _staged_job(), log=lambda line: None)
    assert [line["step"] for line in read_records(out / METRICS_FILE)] == [2]
    calls = count_train_batches(monkeypatch, interrupt_at=None)
    record = run_in_directory(out, _staged_job(), log=lambda line: None)
    assert len(calls) == 3 and record["validation"][0]["stage"] == 0  # the second stage alone, again
    assert record["resumed"] == ["T=16 resumed from record.train0.pt after step 2"]
    def timeless(run):
        return [{key: value for key, value in line.items() if key != "test_seconds"}
                for line in read_records(run / METRICS_FILE)]

    assert timeless(out) == timeless(straight)  # the same lines, each step once


def test_the_evaluation_hook_hears_the_history_and_changes_no_record():
    job = _job()
    heard = []
    plain = train_job(job, log=lambda line: None)
    listened = train_job(job, log=lambda line: None, on_eval=heard.append)
    assert heard == plain["validation"]
    timeless = [{key: value for key, value in record.items() if key != "train_seconds"}
                for record in (plain, listened)]
    assert json.dumps(timeless[0]) == json.dumps(timeless[1])


def test_compare_runs_write_no_metrics(tmp_path):
    records = run_jobs(tmp_path, [_job()], workers=1, progress=lambda line: None, keep_models=True)
    assert "error" not in records["mqar-full-s0"]
    assert (tmp_path / "models" / "mqar-full-s0" / "checkpoint.pt").is_file()
    assert not list(tmp_path.rglob(METRICS_FILE)) and not list(tmp_path.rglob("tensorboard"))


def test_tensorboard_receives_the_task_run_metrics(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines, _ = _train(capsys, tmp_path / "run", "--logger", "tensorboard")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("val/accuracy")] == [2, 4, 6]
    assert [event.value for event in events.Scalars("train/test_accuracy")] == pytest.approx(
        [lines[-1]["test_accuracy"]])


def test_a_logger_that_cannot_run_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    hide_tensorboard(monkeypatch)
    assert main([*MQAR_RUN, "--out", str(tmp_path / "run"), "--logger", "tensorboard"]) == 2
    assert "logger 'tensorboard' needs the tensorboard package" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"logger: one of \['jsonl', 'tensorboard'\]; got 'wandb'"):
        run_in_directory(tmp_path / "run", _job(), logger="wandb")
    assert not (tmp_path / "run").exists()


UNTIMED = ("tokens_per_s", "peak_mem_mib")  # what a training line measures rather than computes


def _untimed(lines):
    return [{key: value for key, value in line.items() if key not in UNTIMED} for line in lines]


def test_log_every_adds_a_training_line_before_each_evaluation_and_leaves_the_weights(tmp_path, capsys):
    plain, plain_record = _train(capsys, tmp_path / "plain")
    lines, record = _train(capsys, tmp_path / "logged", "--log-every", "2")
    training = [line for line in lines if "loss" in line and "train_loss" not in line]
    assert [line["step"] for line in training] == [2, 4, 6]
    for line, evaluation in zip(training, record["validation"], strict=True):
        assert set(line) == {"step", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib"}
        assert line["loss"] == evaluation["train_loss"] and line["tokens_per_s"] > 0
    assert [line for line in lines if line not in training] == plain  # the evaluations' lines as before
    assert record["validation"] == plain_record["validation"] and record["test"] == plain_record["test"]
    assert record["train"]["log_every"] == 2 and "log_every" not in plain_record["train"]
    assert json.loads((tmp_path / "logged" / "config.json").read_text())["log_every"] == 2
    assert "log_every" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_checkpoint_every_resumes_between_evaluations_as_one_never_stopped(tmp_path, capsys, monkeypatch):
    """Evaluated after steps 2, 4, 6 and checkpointed after every step: stopped inside step 4, the run
    resumes after step 3 and ends with the lines and record of one never stopped."""
    every = ("--log-every", "1", "--checkpoint-every", "1")
    straight, straight_record = _train(capsys, tmp_path / "straight", *every)
    out = tmp_path / "interrupted"
    count_train_batches(monkeypatch, interrupt_at=4)
    assert main([*MQAR_RUN, "--out", str(out), *every]) == 130
    capsys.readouterr()
    calls = count_train_batches(monkeypatch, interrupt_at=None)
    resumed, record = _train(capsys, out, *every)
    assert len(calls) == 3 and record["resumed"] == ["resumed from record.train0.pt after step 3"]
    assert _untimed(resumed) == _untimed(straight)
    assert record["validation"] == straight_record["validation"] and record["test"] == straight_record["test"]


def test_the_watch_intervals_may_change_when_a_run_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    count_train_batches(monkeypatch, interrupt_at=5)
    assert main([*MQAR_RUN, "--out", str(out), "--checkpoint-every", "3"]) == 130
    capsys.readouterr()
    count_train_batches(monkeypatch, interrupt_at=None)
    lines, record = _train(capsys, out, "--log-every", "3")
    assert record["resumed"] == ["resumed from record.train0.pt after step 4"]
    assert [line["step"] for line in lines if "lr" in line] == [6]
    assert json.loads((out / "config.json").read_text())["log_every"] == 3
    assert main([*MQAR_RUN, "--out", str(out), "--seed", "2"]) == 2  # a change of what it trains is not
    assert "seed" in capsys.readouterr().err


@pytest.mark.parametrize("argument", ["--log-every", "--checkpoint-every"])
def test_a_negative_interval_is_one_line_naming_it(tmp_path, capsys, argument):
    assert main([*MQAR_RUN, "--out", str(tmp_path / "run"), argument, "-1"]) == 2
    error = capsys.readouterr().err.strip()
    assert argument in error and "\n" not in error and not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
@pytest.mark.parametrize("name", ["log_every", "checkpoint_every"])
def test_a_bad_interval_in_code_names_it(name, value):
    from routeformer.train.task_loop import TaskTrainConfig

    pattern = rf"^{name}: an integer >= 0 \(steps between two; 0: none\); got {value!r}$"
    with pytest.raises(ValueError, match=pattern):
        TaskTrainConfig(**{name: value})
    with pytest.raises(ValueError, match=pattern):
        replace(_job(), **{name: value})


def test_keep_checkpoints_keeps_that_many_while_the_run_trains_and_may_change_on_resume(
        tmp_path, capsys, monkeypatch):
    """Checkpointed after every step and stopped inside step 4: the newest three (after steps 3, 2
    and 1) are kept; resumed with the default, the run ends as one never stopped."""
    every = ("--checkpoint-every", "1")
    _, straight = _train(capsys, tmp_path / "straight", *every)
    out = tmp_path / "interrupted"
    count_train_batches(monkeypatch, interrupt_at=4)
    assert main([*MQAR_RUN, "--out", str(out), *every, "--keep-checkpoints", "3"]) == 130
    capsys.readouterr()
    assert [path.name for path in training_checkpoints(out, "record")] == [
        "record.train0.1.pt", "record.train0.2.pt", "record.train0.pt"]
    assert json.loads((out / "config.json").read_text())["keep_checkpoints"] == 3
    count_train_batches(monkeypatch, interrupt_at=None)
    _, record = _train(capsys, out, *every)
    assert record["resumed"] == ["resumed from record.train0.pt after step 3"]
    assert record["validation"] == straight["validation"] and record["test"] == straight["test"]
    assert "keep_checkpoints" not in json.loads((out / "config.json").read_text())  # the default again


@pytest.mark.parametrize("value", ["0", "-1", "1.5"])
def test_keep_checkpoints_below_one_is_one_line_naming_it(tmp_path, capsys, value):
    assert main([*MQAR_RUN, "--out", str(tmp_path / "run"), "--keep-checkpoints", value]) == 2
    error = capsys.readouterr().err.strip()
    assert "--keep-checkpoints" in error and "\n" not in error and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="^keep_checkpoints: a positive integer"):
        replace(_job(), keep_checkpoints=0)


def test_an_interrupted_run_resumed_with_more_steps_continues_on_the_new_schedule(tmp_path, capsys,
                                                                                  monkeypatch):
    """Stopped in step 5 of 6 (checkpointed after step 4), resumed with --steps 9: it continues from
    step 4 to 9 on the new schedule (eval points and learning rate of 9 steps), keeping its first
    evaluations, and config.json says the new schedule; the config it replaced is kept."""
    out = tmp_path / "run"
    count_train_batches(monkeypatch, interrupt_at=5)
    assert main([*MQAR_RUN, "--out", str(out)]) == 130
    capsys.readouterr()
    before = json.loads((out / "config.json").read_text())
    calls = count_train_batches(monkeypatch, interrupt_at=None)
    assert main([*MQAR_RUN, "--out", str(out), "--steps", "9"]) == 0
    err = capsys.readouterr().err
    assert "the run continues on a changed schedule: setup.schedule.steps 6 -> 9" in err
    record = json.loads((out / "record.json").read_text())
    assert len(calls) == 5 and record["resumed"] == ["resumed from record.train0.pt after step 4"]
    assert [entry["step"] for entry in record["validation"]] == [2, 4, 6, 9]  # 3 evaluations of 9 steps
    assert record["train"]["schedule"]["steps"] == 9
    assert json.loads((out / "config.json").read_text())["setup"]["schedule"]["steps"] == 9
    assert json.loads((out / "config.before-step4.json").read_text()) == before
    lines = read_records(out / METRICS_FILE)
    assert [line["step"] for line in lines if "val_loss" in line] == [2, 4, 6, 9]  # each evaluation once
    changes = {"setup.schedule.steps": [6, 9], "setup.schedule.warmup_steps": [2, 3]}
    assert [line for line in lines if "config_changes" in line] == [  # after step 4, as the LM run says it
        {"step": 4, "config_changes": changes}]
    assert main(["eval", str(out)]) == 0 and json.loads(capsys.readouterr().out)["step"] == 9


def _untimed_record(record):
    return {key: value for key, value in record.items() if key != "train_seconds"}


def test_a_finished_run_trains_on_with_more_steps(tmp_path, capsys, monkeypatch):
    """A finished 6-step run keeps its training checkpoints; run with --steps 9 it continues from step
    6 on the 9-step schedule, as a run stopped after its last step's checkpoint (before its record)
    does, keeping its earlier record and config; eval then reads the model at step 9."""
    out = tmp_path / "run"
    _, finished = _train(capsys, out)
    assert [path.name for path in training_checkpoints(out, "record")] == ["record.train0.1.pt",
                                                                            "record.train0.pt"]
    before = json.loads((out / "config.json").read_text())
    calls = count_train_batches(monkeypatch, interrupt_at=None)
    assert main([*MQAR_RUN, "--out", str(out), "--steps", "9"]) == 0
    assert "the run continues on a changed schedule: setup.schedule.steps 6 -> 9" in capsys.readouterr().err
    record = json.loads((out / "record.json").read_text())
    assert len(calls) == 3 and record["resumed"] == ["resumed from record.train0.pt after step 6"]
    assert record["validation"][:3] == finished["validation"]
    assert [entry["step"] for entry in record["validation"]] == [2, 4, 6, 9]
    assert json.loads((out / "record.before-step6.json").read_text()) == finished
    assert json.loads((out / "config.before-step6.json").read_text()) == before
    lines = read_records(out / METRICS_FILE)
    assert [(line["step"], sorted(set(line) & {"final", "config_changes"})) for line in lines] == [
        (2, []), (4, []), (6, []), (6, ["final"]), (6, ["config_changes"]), (9, []), (9, ["final"])]
    assert main(["eval", str(out)]) == 0 and json.loads(capsys.readouterr().out)["step"] == 9
    assert load_checkpoint(out / "checkpoint.1.pt")["step"] == 6  # the earlier model, kept
    stopped = tmp_path / "stopped"  # the same 6 steps, stopped before its record was stored
    _train(capsys, stopped)
    (stopped / "record.json").unlink()
    _, resumed = _train(capsys, stopped, "--steps", "9")
    assert _untimed_record(resumed) == _untimed_record(record)


def test_a_schedule_change_is_refused_without_steps_to_train_or_past_the_checkpoint(tmp_path, capsys,
                                                                                      monkeypatch):
    out = tmp_path / "run"
    _train(capsys, out)
    assert main([*MQAR_RUN, "--out", str(out), "--lr", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "holds a finished run (setup.schedule.lr 0.003 -> 0.01)" in err
    assert "only with more steps than the 6 it has" in err and "\n" not in err.strip()
    for path in training_checkpoints(out, "record"):
        path.unlink()
    assert main([*MQAR_RUN, "--out", str(out), "--steps", "9"]) == 2
    assert "without its training state" in capsys.readouterr().err
    assert not list(out.glob("*.before-step*"))
    stopped = tmp_path / "stopped"
    count_train_batches(monkeypatch, interrupt_at=5)
    assert main([*MQAR_RUN, "--out", str(stopped)]) == 130
    capsys.readouterr()
    config = (stopped / "config.json").read_text()
    count_train_batches(monkeypatch, interrupt_at=None)
    assert main([*MQAR_RUN, "--out", str(stopped), "--steps", "3"]) == 2
    assert "is at step 4, past the 3 steps the run now has" in capsys.readouterr().err
    assert (stopped / "config.json").read_text() == config and not list(stopped.glob("*.before-step*"))
    assert main([*MQAR_RUN, "--out", str(stopped), "--seed", "2"]) == 2  # not a schedule change
    assert "holds a run of another config" in capsys.readouterr().err


def test_a_run_whose_checkpoints_are_all_corrupt_refuses_to_start_over_and_keeps_its_metrics(
        tmp_path, capsys, monkeypatch):
    """Stopped in step 5 (checkpoints after steps 4 and 2), both checkpoints damaged: a rerun is one
    line naming what it would replace, and changes nothing; --fresh starts over."""
    _, straight = _train(capsys, tmp_path / "straight")
    out = tmp_path / "run"
    count_train_batches(monkeypatch, interrupt_at=5)
    assert main([*MQAR_RUN, "--out", str(out)]) == 130
    capsys.readouterr()
    for path in training_checkpoints(out, "record"):
        path.write_bytes(path.read_bytes()[:100])
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    count_train_batches(monkeypatch, interrupt_at=None)
    assert main([*MQAR_RUN, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert ("holds metrics.jsonl of an earlier run (up to step 4) and 2 training checkpoint(s), none "
            "intact") in err
    assert "use --fresh" in err and "\n" not in err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    for path in training_checkpoints(out, "record"):  # a resume that moved them aside left metrics alone
        path.rename(path.with_name(path.name + ".corrupt"))
    assert main([*MQAR_RUN, "--out", str(out)]) == 2
    assert "record.train0.pt.corrupt" in capsys.readouterr().err
    _, fresh = _train(capsys, out, "--fresh")
    assert fresh["validation"] == straight["validation"] and fresh["test"] == straight["test"]
    assert not list(out.glob("*.corrupt"))


def test_a_finished_lm_config_run_trains_on_with_more_steps_and_another_evaluation_size(tmp_path, capsys):
    out = tmp_path / "run"
    run = ["train", "--task", "lm", "--config", "tiny", "--train.eval_every", "2", "--train.eval_tokens",
           "128", "--train.final_eval_tokens", "256", "--out", str(out)]
    assert main([*run, "--train.steps", "4"]) == 0
    capsys.readouterr()
    assert main([*run, "--train.steps", "4"]) == 0  # read back
    assert "already finished at step 4 (record.json read back); nothing to train" in capsys.readouterr().err
    assert main([*run, "--train.steps", "6", "--train.eval_tokens", "256"]) == 0
    err = capsys.readouterr().err
    assert "changed schedule: setup.evals 2 -> 3, setup.schedule.steps 4 -> 6" in err
    assert "setup.validation_sequences" in err
    record = json.loads((out / "record.json").read_text())
    assert [entry["step"] for entry in record["validation"]] == [2, 4, 6]
    assert record["resumed"] == ["resumed from record.train0.pt after step 4"]
