"""Every run directory keeps its trained model: `routeformer train --task NAME` writes `checkpoint.pt`
in the layout of `routeformer train`, which `eval` (the task's metric), `sample` (text tasks),
`export-hf` (causal models) and `train.checkpoint.load_run_model` read; eval and export-hf apply
one rule to a damaged run directory and name the step they would read."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from routeformer.cli import main
from routeformer.cli.parser import build_task_train_parser
from routeformer.cli.task_train import task_run_job
from routeformer.models.heads import CausalLM, TokenPredictor
from routeformer.runner.jobs import train_job
from routeformer.tasks import list_tasks
from routeformer.train.checkpoint import (
    checkpoint_files,
    is_task_model,
    load_checkpoint,
    load_run_model,
    save_task_model,
)
from routeformer.train.task_loop import training_checkpoints
from tests.extras import require
from tests.train.earlier_layout import earlier_lm_run

# a few steps each, evaluated (and checkpointed by the task loop) twice
MQAR_RUN = ["train", "--task", "mqar", "--steps", "4", "--evals", "2", "--batch-size", "16", "--seed", "1"]
LM_RUN = ["train", "--task", "lm", "--seq-len", "16", "--steps", "4", "--evals", "2", "--batch-size", "8"]


def _run(capsys, argv):
    """(exit status, stdout, stderr) of one command."""
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _last_json(text):
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mqar_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mqar") / "run"
    assert main([*MQAR_RUN, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm") / "run"
    assert main([*LM_RUN, "--out", str(out)]) == 0
    return out


def test_a_task_run_keeps_its_model_in_the_lm_layout(mqar_run):
    record = json.loads((mqar_run / "record.json").read_text())
    assert checkpoint_files(mqar_run) == [mqar_run / "checkpoint.pt"]
    # the loop's training state, kept beside the model so that the run may train on
    assert [path.name for path in training_checkpoints(mqar_run, "record")] == ["record.train0.1.pt",
                                                                                "record.train0.pt"]
    state = load_checkpoint(mqar_run)
    assert is_task_model(state) and state["step"] == 4
    assert state["task"] == {"name": "mqar", "options": record["task_options"]}
    assert state["run"] == json.loads((mqar_run / "config.json").read_text())
    assert "vocab" not in state  # mqar's tokens are not text

    run = load_run_model(mqar_run)
    assert isinstance(run.model, CausalLM) and not run.model.training
    assert run.task.describe() == record["task"] and run.step == 4 and run.tokenizer is None
    assert run.checkpoint == mqar_run / "checkpoint.pt" and run.config == state["run"]
    assert sum(p.numel() for p in run.model.parameters()) == record["parameters"]


def test_eval_of_a_task_run_gives_the_metrics_training_recorded(mqar_run, capsys):
    record = json.loads((mqar_run / "record.json").read_text())
    status, out, _ = _run(capsys, ["eval", str(mqar_run)])
    assert status == 0
    evaluated = json.loads(out)
    assert evaluated["metric"] == "accuracy" and evaluated["split"] == "validation" and evaluated["step"] == 4
    assert evaluated["checkpoint"] == str(mqar_run / "checkpoint.pt")
    final = record["validation"][-1]  # evaluated at the last step, on the same sample
    assert evaluated["accuracy"] == final["accuracy"] and evaluated["loss"] == final["loss"]
    status, out, _ = _run(capsys, ["eval", str(mqar_run), "--split", "test"])
    tested = json.loads(out)
    assert status == 0 and tested["sequences"] == 1024
    assert {key: tested[key] for key in record["test"]} == record["test"]
    status, out, err = _run(capsys, ["eval", str(mqar_run), "--max-tokens", "64"])
    assert status == 2 and out == "" and "argument --corpus/--max-tokens: apply to LM run directories" in err


def test_export_hf_of_a_causal_task_run_gives_the_same_logits(mqar_run, tmp_path, capsys):
    transformers = require("transformers", "hf")
    import routeformer.integrations.hf  # noqa: F401  (registers the model with transformers)

    out = tmp_path / "hf"
    status, printed, _ = _run(capsys, ["export-hf", str(mqar_run), str(out)])
    assert status == 0
    assert f"from {str(mqar_run / 'checkpoint.pt')!r} (step 4)" in printed
    assert "no text tokeniser" in printed and not (out / "routeformer_vocab.json").exists()
    source = json.loads((out / "routeformer_run.json").read_text())
    assert source["step"] == 4 and source["task"]["name"] == "mqar"
    run = load_run_model(mqar_run)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    inputs, _ = run.task.fixed_sample("test", 4)
    with torch.no_grad():
        torch.testing.assert_close(exported(inputs).logits, run.model(inputs).logits, atol=0, rtol=0)


def test_sample_refuses_a_task_whose_tokens_are_not_text(mqar_run, capsys):
    status, out, err = _run(capsys, ["sample", str(mqar_run), "--prompt", "ab"])
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("routeformer: error: sample: ")
    assert "is a run of task 'mqar', whose tokens are not text" in err and "routeformer eval" in err


def test_an_lm_task_run_evaluates_samples_and_exports(lm_run, tmp_path, capsys):
    record = json.loads((lm_run / "record.json").read_text())
    status, out, _ = _run(capsys, ["eval", str(lm_run)])
    evaluated = json.loads(out)
    assert status == 0 and evaluated["metric"] == "bits_per_char"
    assert evaluated["bits_per_char"] == record["validation"][-1]["bits_per_char"]

    status, out, err = _run(capsys, ["sample", str(lm_run), "--prompt", "def", "--tokens", "8"])
    assert status == 0 and out.startswith("def") and len(out.rstrip("\n")) == 11
    assert f"sampled from {str(lm_run / 'checkpoint.pt')!r} (step 4)" in err
    run = load_run_model(lm_run)
    assert run.tokenizer.tokens == run.task.vocab.tokens  # the task's own vocabulary

    transformers = require("transformers", "hf")
    import routeformer.integrations.hf  # noqa: F401

    hf = tmp_path / "hf"
    status, out, _ = _run(capsys, ["export-hf", str(lm_run), str(hf)])
    assert status == 0 and "(step 4)" in out and "tokenizer_from_dict" in out
    vocab = json.loads((hf / "routeformer_vocab.json").read_text())
    assert vocab == run.tokenizer.to_dict()
    ids = run.tokenizer.encode("def main():")[None]
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, run.model(ids).logits, atol=0, rtol=0)


def test_a_bidirectional_task_run_evaluates_but_neither_samples_nor_exports(tmp_path, capsys):
    out = tmp_path / "listops"
    assert main(["train", "--task", "listops", "--steps", "2", "--evals", "1", "--batch-size", "8",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    run = load_run_model(out)
    assert type(run.model) is TokenPredictor and not run.model.config.causal
    status, printed, _ = _run(capsys, ["eval", str(out)])
    assert status == 0 and json.loads(printed)["metric"] == "accuracy"
    status, _, err = _run(capsys, ["sample", str(out)])
    assert status == 2 and "is a run of task 'listops'" in err and err.count("\n") == 1
    require("transformers", "hf")
    status, _, err = _run(capsys, ["export-hf", str(out), str(tmp_path / "hf")])
    assert status == 2 and err.count("\n") == 1
    assert "is a run of task 'listops', whose model reads the whole sequence (causal=False)" in err
    assert not (tmp_path / "hf").exists()


def test_a_refused_option_writes_nothing_and_the_corrected_command_runs(tmp_path, capsys):
    out = tmp_path / "run"
    status, printed, err = _run(capsys, [*MQAR_RUN, "--steps", "2", "--evals", "1", "--option", "pairs=0",
                                         "--out", str(out)])
    assert status == 2 and printed == "" and err.count("\n") == 1
    assert "task 'mqar' cannot be built with options" in err and "pairs must be a positive integer" in err
    assert not out.exists()
    out.mkdir()  # an existing directory stays as it was
    assert main([*MQAR_RUN, "--steps", "2", "--evals", "1", "--option", "pairs=0", "--out", str(out)]) == 2
    assert list(out.iterdir()) == []
    capsys.readouterr()
    status, printed, _ = _run(capsys, [*MQAR_RUN, "--steps", "2", "--evals", "1", "--out", str(out)])
    assert status == 0 and _last_json(printed)["checkpoint"] == str(out / "checkpoint.pt")


def test_eval_and_export_hf_name_the_same_step_when_the_newest_checkpoint_is_truncated(tmp_path, capsys):
    run = earlier_lm_run(tmp_path / "run")  # the earlier LM layout: rotating checkpoints at steps 2, 4
    newest = run / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:-100])
    refusal = f"its newest intact one is {str(run / 'checkpoint.1.pt')!r} (step 2)"
    status, _, err = _run(capsys, ["eval", str(run)])
    assert status == 2 and refusal in err
    require("transformers", "hf")
    status, _, err = _run(capsys, ["export-hf", str(run), str(tmp_path / "hf")])
    assert status == 2 and refusal in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()
    # the older state, named explicitly, is read by both, which say its step
    status, out, _ = _run(capsys, ["eval", str(run / "checkpoint.1.pt"), "--max-tokens", "256"])
    assert status == 0 and json.loads(out)["step"] == 2
    status, _, err = _run(capsys, ["eval", str(run / "checkpoint.1.pt"), "--split", "test"])
    assert status == 2 and "argument --split/--sequences: apply to task runs" in err
    status, out, _ = _run(capsys, ["export-hf", str(run / "checkpoint.1.pt"), str(tmp_path / "hf")])
    assert status == 0 and f"from {str(run / 'checkpoint.1.pt')!r} (step 2)" in out


def test_readers_of_a_run_with_no_intact_checkpoint_do_not_advise_a_train_flag(mqar_run, tmp_path, capsys):
    run = Path(shutil.copytree(mqar_run, tmp_path / "run"))
    (run / "checkpoint.pt").write_bytes((run / "checkpoint.pt").read_bytes()[:-100])
    for command in (["sample", str(run)], ["eval", str(run)]):
        status, _, err = _run(capsys, command)
        line = err.strip().splitlines()[-1]
        assert status == 2 and line.startswith("routeformer: error: no intact checkpoint in")
        assert "train the run again (its `routeformer train` command with --fresh" in line
        assert not line.endswith("start over with --fresh")


def test_a_task_run_without_a_checkpoint_says_what_to_run(mqar_run, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(mqar_run / "config.json", unfinished)
    status, _, err = _run(capsys, ["eval", str(unfinished)])
    assert status == 2 and "holds a task run that has not finished" in err and err.count("\n") == 1
    shutil.copy(mqar_run / "record.json", unfinished)
    status, _, err = _run(capsys, ["sample", str(unfinished)])
    assert status == 2 and "holds a task run's record.json but no checkpoint of its model" in err


def test_a_task_run_refuses_a_directory_of_another_kind_of_run(tmp_path, capsys):
    run = earlier_lm_run(tmp_path / "run")
    before = sorted(path.name for path in run.iterdir())
    status, _, err = _run(capsys, [*MQAR_RUN, "--out", str(run)])
    assert status == 2 and "holds checkpoints but no config.json of a task run" in err
    assert sorted(path.name for path in run.iterdir()) == before
    assert main([*MQAR_RUN, "--steps", "2", "--evals", "1", "--out", str(run), "--fresh"]) == 0
    assert checkpoint_files(run) == [run / "checkpoint.pt"]  # the LM run's checkpoints are gone
    assert load_checkpoint(run)["task"]["name"] == "mqar"


def test_keeping_the_model_changes_nothing_in_training(tmp_path):
    options = build_task_train_parser().parse_args(["--steps", "3", "--evals", "1", "--batch-size", "8"])
    job = task_run_job("mqar", options)
    plain = train_job(job, log=lambda line: None)
    kept = []
    keeping = train_job(job, log=lambda line: None, keep_model=lambda model: kept.append(
        save_task_model(tmp_path, model, step=3, task="mqar", task_options=job.task_options, run={})))
    assert kept == [tmp_path / "checkpoint.pt"]
    assert keeping["validation"] == plain["validation"] and keeping["test"] == plain["test"]
    trained = load_run_model(tmp_path).model
    assert trained.config.attention == "full" and trained.config.vocab_size == job.task_options["vocab_size"]


@pytest.mark.parametrize("task, mechanism", [("mqar", "full"), ("mqar", "topk"), ("code_lm", "local"),
                                             ("mqar_512", "meta")])
def test_budget_long_is_the_job_compare_long_trains(task, mechanism):
    from dataclasses import replace

    from routeformer.compare.budgets import LONG
    from routeformer.compare.run import compare_jobs

    arguments = ["--budget", "long", "--mechanism", mechanism, "--seed", "1"]
    options = build_task_train_parser().parse_args(arguments)
    job = task_run_job(task, options)
    compared = next(j for j in compare_jobs([task], [mechanism], LONG, "unused") if j.seed == 1)
    assert replace(job, key=compared.key) == compared  # same task, options, stages, backbone, seed


def test_budget_long_refuses_what_it_cannot_train():
    parse = build_task_train_parser().parse_args
    with pytest.raises(ValueError, match="--budget long has the tasks"):
        task_run_job("listops", parse(["--budget", "long"]))
    with pytest.raises(ValueError, match="argument --seq-len: --budget long trains at its own lengths"):
        task_run_job("mqar", parse(["--budget", "long", "--seq-len", "64"]))


def test_budget_long_run_prints_its_curriculum_summary(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    import routeformer.compare.budgets as budgets
    from routeformer.compare.budgets import Stage, curriculum_setup
    from routeformer.train.schedule import Schedule

    toy = Schedule(steps=2, batch_size=4, lr=1e-3, warmup_steps=1)
    setup = curriculum_setup({"seq_len": 32, "pairs": 4, "vocab_size": 16},
                             (Stage({"seq_len": 16, "pairs": 2}, toy), Stage({}, replace(toy, steps=3))),
                             evals=1, validation_sequences=8, test_tokens=256)
    monkeypatch.setattr(budgets, "LONG", replace(budgets.LONG, tasks={**budgets.LONG.tasks, "mqar": setup}))
    run = tmp_path / "long"
    status, out, _ = _run(capsys, ["train", "--task", "mqar", "--budget", "long", "--out", str(run)])
    assert status == 0
    summary = _last_json(out)
    assert summary["steps"] == 5  # both stages
    assert set(summary["test"]) == {"32", "64", "128"}  # T and the longer lengths
    assert 0.0 <= summary["test"]["32"]["accuracy"] <= 1.0
    assert summary["checkpoint"] == str(run / "checkpoint.pt")


def test_model_and_mechanism_overrides_reach_the_job():
    options = build_task_train_parser().parse_args(
        ["--mechanism", "topk", "--mechanism-option", "topk=4",
         "--mechanism-option", "routing_positions=none",
         "--model.dim", "32", "--model.depth", "1", "--model.heads", "4", "--model.positions", "learned"])
    job = task_run_job("mqar", options)
    assert (job.spec.dim, job.spec.depth, job.spec.heads, job.spec.positions) == (32, 1, 4, "learned")
    assert job.options["topk"] == 4 and job.options["routing_positions"] == "none"
    plain = task_run_job("mqar", build_task_train_parser().parse_args(["--mechanism", "topk"]))
    assert plain.spec.dim == 64 and "routing_positions" not in plain.options


@pytest.mark.parametrize("arguments, message", [
    (["--mechanism", "topk", "--mechanism-option", "nope=3"], r"--mechanism-option: .*'topk'.*got 'nope=3'"),
    (["--mechanism-option", "window"], r"--mechanism-option: expected KEY=VALUE"),
    (["--model.heads", "3"], r"--model.heads: must divide model.dim 64; got 3"),
    (["--model.positions", "abs"], r"--model.positions: one of \['learned', 'rotary', 'none'\]; got 'abs'"),
    (["--model.dim", "0"], r"--model.dim: must be an integer >= 1"),
])
def test_bad_overrides_are_one_line_and_write_nothing(capsys, tmp_path, arguments, message):
    import re

    run = tmp_path / "run"
    status, _, err = _run(capsys, ["train", "--task", "mqar", *arguments, "--out", str(run)])
    assert status == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not run.exists()


@pytest.mark.parametrize("task", sorted(list_tasks()))
def test_every_registered_task_keeps_a_model_that_eval_reads(task, tmp_path, capsys):
    out = tmp_path / task
    length = ["--seq-len", "64"] if "seq_len" in list_tasks()[task] else []
    assert main(["train", "--task", task, *length, "--steps", "2", "--evals", "1", "--batch-size", "4",
                 "--out", str(out)]) == 0
    assert Path(_last_json(capsys.readouterr().out)["checkpoint"]).is_file()
    record = json.loads((out / "record.json").read_text())
    status, printed, _ = _run(capsys, ["eval", str(out), "--split", "test"])
    tested = json.loads(printed)
    assert status == 0 and {key: tested[key] for key in record["test"]} == record["test"]
