"""`routeformer sparsify SRC --mechanism topk --out DIR`: a dense task run converted into a task run
directory that eval, export-hf and load_run_model read, recording what it converted from and what
it spent; bad input is one line, exit 2, and nothing written."""

import json
import re

import pytest
import torch

from routeformer.cli import main
from routeformer.train.checkpoint import load_checkpoint, load_run_model
from tests.extras import require

DENSE_RUN = ["train", "--task", "mqar", "--steps", "20", "--evals", "1", "--batch-size", "16", "--seed", "1"]
CONVERT = ["--mechanism", "topk", "--option", "topk=8", "--steps", "6", "--sparse-steps", "4",
           "--batch-size", "8", "--seed", "2"]


def _run(capsys, argv):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "run"
    assert main([*DENSE_RUN, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def routed_run(dense_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("routed") / "run"
    assert main(["sparsify", str(dense_run), *CONVERT, "--out", str(out)]) == 0
    return out


def test_the_converted_run_records_its_source_and_cost(dense_run, routed_run):
    record = json.loads((routed_run / "record.json").read_text())
    assert record["source"] == str(dense_run) and record["source_step"] == 20
    assert record["stages"]["dense_warmup"]["steps"] == 6 and record["stages"]["sparse"]["steps"] == 4
    assert record["tokens"] == (6 + 4) * 8 * 32 and record["source_tokens"] == 20 * 16 * 32
    assert record["tokens_fraction_of_source"] == pytest.approx(record["tokens"] / record["source_tokens"])
    assert 0.0 <= record["test"]["routing_recall"] <= 1.0
    run = load_run_model(routed_run)
    assert run.model.config.attention == "topk" and run.config["options"]["topk"] == 8
    assert run.config["sparsify"]["source"] == str(dense_run)
    dense = load_run_model(dense_run).model.state_dict()
    routed = run.model.state_dict()
    changed = [name for name, tensor in dense.items() if not torch.equal(routed[name], tensor)]
    assert changed  # stage 2 trained the dense weights too


def test_eval_reads_the_converted_run(capsys, routed_run):
    status, out, err = _run(capsys, ["eval", str(routed_run)])
    assert status == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["metric"] == "accuracy" and "routing_recall" in result


def test_export_hf_reads_the_converted_run(capsys, routed_run, tmp_path):
    require("routeformer.integrations.hf", "hf")
    status, out, err = _run(capsys, ["export-hf", str(routed_run), str(tmp_path / "hf")])
    assert status == 0, err
    assert (tmp_path / "hf" / "config.json").is_file()


def test_the_conversion_is_deterministic_given_the_seed(dense_run, routed_run, tmp_path):
    again = tmp_path / "again"
    assert main(["sparsify", str(dense_run), *CONVERT, "--out", str(again)]) == 0
    first = load_checkpoint(routed_run / "checkpoint.pt")["model"]
    for name, tensor in load_checkpoint(again / "checkpoint.pt")["model"].items():
        assert torch.equal(tensor, first[name]), name


@pytest.mark.parametrize("arguments, message", [
    (["--mechanism", "local"], r"'local' does not convert from a dense model"),
    (["--mechanism", "mita"], r"sparse_steps must be >= 1: a 'mita' model has nothing to train in stage 1"),
    (["--mechanism", "mita", "--steps", "3", "--sparse-steps", "2"], r"steps must be 0: a 'mita' model"),
    (["--mechanism", "nope"], r"'nope' is not registered"),
    (["--mechanism", "topk", "--option", "nonsense=3"], r"'topk' has no option 'nonsense'"),
    (["--mechanism", "topk", "--option", "topk"], r"expected KEY=VALUE; got 'topk'"),
    (["--mechanism", "topk", "--option", "routing_learning=none"], r"routing_learning='none'"),
    (["--mechanism", "topk", "--steps", "0"], r"steps must be >= 1: a 'topk' model has routing parameters"),
    (["--mechanism", "topk", "--steps", "-1"], r"--steps: must be an integer >= 0"),
])
def test_bad_arguments_are_one_line_and_write_nothing(capsys, dense_run, tmp_path, arguments, message):
    out = tmp_path / "out"
    status, _, err = _run(capsys, ["sparsify", str(dense_run), *arguments, "--out", str(out)])
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("routeformer: error: ")
    assert re.search(message, err), err
    assert not out.exists()


def test_bad_sources_are_refused(capsys, dense_run, routed_run, tmp_path):
    out = tmp_path / "out"
    cases = [(tmp_path / "missing", r"does not exist; SRC must be a run directory of `routeformer train"),
             (routed_run, r"source layer 0 runs 'topk'.*no dense attention to copy")]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "checkpoint.pt").write_bytes(b"not a checkpoint")
    cases.append((corrupt, r"checkpoint"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cases.append((hf, r"transformers model directory, which converts in Python"))
    for source, message in cases:
        status, _, err = _run(capsys, ["sparsify", str(source), "--mechanism", "topk", "--out", str(out)])
        # a corrupt file is also named on a warning line before the error, as eval does
        assert status == 2 and err.strip().splitlines()[-1].startswith("routeformer: error: "), err
        assert re.search(message, err), err
        assert not out.exists()
    argv = ["sparsify", str(dense_run), "--mechanism", "topk", "--out", str(routed_run)]
    status, _, err = _run(capsys, argv)
    assert status == 2 and "exists; name a new directory" in err


LM_RUN = ["--config", "tiny", "--steps", "10", "--final_eval_tokens", "256"]
LM_CONVERT = ["--mechanism", "topk", "--option", "topk=4", "--steps", "3", "--sparse-steps", "2",
              "--batch-size", "4", "--seed", "2"]


def test_an_lm_run_converts_as_the_task_lm_run_it_equals(capsys, tmp_path):
    lm, task = tmp_path / "lm", tmp_path / "task"
    assert main(["train", *LM_RUN, "--out_dir", str(lm)]) == 0
    assert main(["train", "--task", "lm", *LM_RUN, "--out", str(task)]) == 0
    records = []
    for source in (lm, task):
        out = tmp_path / f"{source.name}-topk"
        status, _, err = _run(capsys, ["sparsify", str(source), *LM_CONVERT, "--out", str(out)])
        assert status == 0, err
        records.append(json.loads((out / "record.json").read_text()))
        assert load_run_model(out).config["task"] == "lm"
    from_lm, from_task = records
    assert from_lm["metric"] == "bits_per_char" and from_lm["source_tokens"] == 10 * 8 * 32
    assert from_lm["test"] == from_task["test"]  # the same weights, task and conversion


def test_an_lm_run_whose_text_changed_since_is_refused(capsys, tmp_path):
    from tests.tasks.test_lm_text_sources import text_file

    text = text_file(tmp_path / "notes.txt")
    lm, out = tmp_path / "lm", tmp_path / "out"
    assert main(["train", *LM_RUN, "--data.path", text, "--out_dir", str(lm)]) == 0
    capsys.readouterr()  # the training run's own lines
    with open(text, "a") as handle:
        handle.write("Zebras quoth: ~{}\n" * 50)  # characters the run's tokeniser never saw
    status, _, err = _run(capsys, ["sparsify", str(lm), *LM_CONVERT, "--out", str(out)])
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "the run's tokeniser is not its task's now" in err, err
    assert not out.exists()
