"""A run with a mechanism per layer: `Job.mechanism` a list of registered names (one per layer) with
`options` keyed by name. It reads back from its config.json form unchanged, trains through
`train_job` and the command line (`train --spec`), and keeps a model whose layers run what the list
says, which eval and export-hf read; options for a mechanism that is no layer's, or a list of the
wrong length, are refused naming them."""

import json
from dataclasses import replace

import pytest

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.runner.jobs import Job, job_config, train_job
from routeformer.runner.spec import job_from_dict
from routeformer.tasks import build_task
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import ModelSpec, build_task_model, layer_attention, mechanism_label
from routeformer.train.schedule import Schedule
from tests.extras import require

LAYERS = ["local", "full"]


def _job(**changes) -> Job:
    setup = replace(QUICK.tasks["mqar"], schedule=Schedule(steps=2, batch_size=8, lr=1e-3, warmup_steps=1),
                    evals=1, validation_sequences=8, test_sequences=8)
    return replace(Job("hybrid", "mqar", dict(setup.options), LAYERS, {"local": {"window": 4}}, 0, setup,
                       ModelSpec(dim=16, depth=2, heads=2, positions="rotary")), **changes)


def test_a_per_layer_job_reads_back_unchanged_and_trains_the_layers_it_names():
    job = _job()
    data = json.loads(json.dumps(job_config(job)))
    assert data["mechanism"] == LAYERS and job_from_dict(data) == job
    kept = {}
    record = train_job(job, log=lambda line: None, keep_model=lambda model: kept.setdefault("model", model))
    assert record["mechanism"] == LAYERS and 0.0 <= record["quality"] <= 1.0
    model = kept["model"]
    assert model.config.layer_attention() == LAYERS
    assert model.config.attention_options == {"local": {"window": 4}}


def test_train_spec_runs_a_per_layer_job_into_a_directory_named_by_its_layers(tmp_path, capsys, monkeypatch):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(job_config(_job())))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--spec", str(spec)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out_dir"] == "runs/train-mqar-local+full-seed0" and summary["mechanism"] == LAYERS
    run = tmp_path / summary["out_dir"]
    assert load_run_model(run).model.config.layer_attention() == LAYERS
    assert main(["eval", str(run)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["metric"] == "accuracy"
    require("routeformer.integrations.hf", "hf")
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_one_name_keeps_its_options_unkeyed():
    assert layer_attention("local", {"window": 4}) == ("local", {"local": {"window": 4}})
    assert layer_attention("full", {}) == ("full", {})
    assert layer_attention(LAYERS, {"local": {"window": 4}, "full": {}}) == (LAYERS, {"local": {"window": 4}})
    assert mechanism_label("local") == "local"
    assert mechanism_label(["local", "local", "full"]) == "local+local+full"


def test_options_of_no_layer_and_a_list_of_the_wrong_length_are_refused_naming_them():
    task = build_task("mqar", **QUICK.tasks["mqar"].options)
    spec = ModelSpec(dim=16, depth=2, heads=2, positions="rotary")
    with pytest.raises(ValueError, match=r"^options: with a mechanism per layer \(\['local', 'full'\]\) the "
                                         r"options are keyed by the layers' mechanisms; got options for "
                                         r"\['topk'\]$"):
        build_task_model(task, LAYERS, {"topk": {"topk": 4}}, spec)
    with pytest.raises(ValueError, match=r"model.attention lists 3 mechanisms but model.depth is 2"):
        build_task_model(task, ["local", "full", "full"], {}, spec)
