"""Nothing a user has is overwritten or dropped by a rerun: one test per fault.

| fault                                               | what the rerun must do                          |
|-----------------------------------------------------|-------------------------------------------------|
| every training checkpoint corrupt (or moved aside)  | refuse without --fresh (exit 2), keep metrics   |
| metrics.jsonl but no checkpoint (killed early)      | refuse without --fresh (exit 2), keep metrics   |
| the model's checkpoint corrupt: eval / sample       | refuse in one line, saying how to train it again |
| eval / sample of an intact run                      | name the checkpoint file and step they used     |
| a finished run run again                            | no second "final" line, nothing rewritten       |
| a killed process left half a line in metrics.jsonl  | the resume drops it, the other records stay     |
| compare --no-bench after a compare with the bench   | keep the bench section and the earlier wall time|
| export-hf                                           | print how to load what it wrote                 |
"""

import json
import shutil

import pytest

from routeformer.cli import main
from routeformer.train.checkpoint import checkpoint_files, load_checkpoint
from tests.extras import require
from tests.train.test_checkpoint import damage

TRAINING = "record.train0"  # the stem of an LM run directory's training checkpoints
TRAIN = ["train", "--config", "tiny", "--steps", "12", "--checkpoint_every", "5", "--eval_every", "6",
         "--log_every", "2", "--eval_tokens", "512", "--final_eval_tokens", "1024"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 12-step LM run: its model checkpoint.pt (step 12), record.json, and the training
    checkpoints record.train0.pt (step 12) and record.train0.1.pt (step 10)."""
    run = tmp_path_factory.mktemp("faults") / "run"
    assert main([*TRAIN, "--out_dir", str(run)]) == 0
    return run


@pytest.fixture
def run(finished, tmp_path):
    return shutil.copytree(finished, tmp_path / "run")


@pytest.fixture
def stopped(run):
    """The run as a process killed after its last training checkpoint, before its model and record."""
    (run / "record.json").unlink()
    (run / "checkpoint.pt").unlink()
    return run


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("routeformer: error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_every_checkpoint_corrupt_refuses_to_start_over_and_keeps_the_metrics(stopped, capsys):
    run = stopped
    metrics = (run / "metrics.jsonl").read_bytes()
    for path in checkpoint_files(run, TRAINING):
        damage(path, "overwritten")
    for attempt in ("first rerun", "second rerun"):
        assert main([*TRAIN, "--out_dir", str(run)]) == 2, attempt
        line = one_error_line(capsys)
        assert "--fresh" in line and "2 training checkpoint(s), none intact" in line, attempt
        assert (run / "metrics.jsonl").read_bytes() == metrics, attempt
    assert "metrics.jsonl of an earlier run (up to step 12)" in line
    for path in checkpoint_files(run, TRAINING):  # as a resume that moved them aside leaves them
        path.rename(path.with_name(path.name + ".corrupt"))
    assert main([*TRAIN, "--out_dir", str(run)]) == 2
    assert "record.train0.pt.corrupt" in one_error_line(capsys)
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert main([*TRAIN, "--out_dir", str(run), "--fresh"]) == 0  # the explicit start-over still works


def test_metrics_without_any_checkpoint_refuse_to_start_over(stopped, capsys):
    run = stopped
    for path in checkpoint_files(run, TRAINING):
        path.unlink()  # killed before the first checkpoint
    metrics = (run / "metrics.jsonl").read_bytes()
    assert main([*TRAIN, "--out_dir", str(run)]) == 2
    assert "no intact checkpoint to resume from" in one_error_line(capsys)
    assert (run / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("command", [["eval", "--sequences", "8"], ["sample", "--tokens", "4"]])
def test_eval_and_sample_refuse_a_corrupt_model_checkpoint(run, capsys, command):
    damage(run / "checkpoint.pt", "overwritten")
    assert main([command[0], str(run), *command[1:]]) == 2
    line = one_error_line(capsys)
    assert "no intact checkpoint" in line and "--fresh" in line


def test_eval_and_sample_name_the_checkpoint_and_step(run, capsys):
    assert main(["eval", str(run), "--sequences", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 12 and result["checkpoint"] == str(run / "checkpoint.pt")
    assert main(["sample", str(run), "--tokens", "4"]) == 0
    assert f"sampled from '{run / 'checkpoint.pt'}' (step 12)" in capsys.readouterr().err


def test_a_finished_run_is_not_finished_again(run, capsys):
    before = {path.name: path.read_bytes() for path in run.iterdir()}
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert main([*TRAIN, "--out_dir", str(run)]) == 0
    captured = capsys.readouterr()
    assert "already finished at step 12" in captured.err
    assert json.loads(captured.out)["test"]["bits_per_char"] == final["test_bits_per_char"]
    assert {path.name: path.read_bytes() for path in run.iterdir()} == before  # no second "final" line


def test_half_a_metrics_line_is_dropped_on_resume(stopped):
    run = stopped
    checkpoint_files(run, TRAINING)[0].unlink()  # resumes from step 10
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 13, "loss": 2.')  # a process killed mid-write
    assert main([*TRAIN, "--out_dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("final")] == [12] and records[0]["step"] == 2
    assert load_checkpoint(run)["step"] == 12


def test_compare_without_the_bench_keeps_the_earlier_bench_and_wall_time(tmp_path):
    from routeformer.compare.run import run_compare
    from tests.compare.test_compare import toy_budget

    out = tmp_path / "compare"
    selection = dict(mechanisms=["full"], tasks=["mqar"], budget=toy_budget(seeds=1), workers=1)
    run_compare(out, **selection)
    first = json.loads((out / "result.json").read_text())
    report = run_compare(out, bench=False, **selection)
    second = json.loads((out / "result.json").read_text())
    assert second["bench"] == first["bench"] and second["bench_from_earlier_invocation"]
    assert second["invocations"][0] == first["invocations"][0]
    assert second["invocations"][1]["command"].endswith("--no-bench")
    text = report.read_text()
    assert "## Layer time and memory vs T" in text and "this one ran with `--no-bench`" in text
    assert f"earlier invocations that wrote this report: {first['elapsed_seconds']:.0f} s" in text


def test_export_hf_says_how_to_load_what_it_wrote(tmp_path, capsys, monkeypatch):
    require("transformers", "hf")
    from routeformer.integrations.hf import export

    monkeypatch.setattr(export, "export_hf", lambda run_dir, out_dir: tmp_path / "hf")
    assert main(["export-hf", "RUN", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "import routeformer.integrations.hf" in out and "AutoModelForCausalLM.from_pretrained(" in out
