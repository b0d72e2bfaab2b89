"""Task runs' dropout: `--model.dropout P` (ModelSpec.dropout) trains with dropout P, recorded in
config.json and the record; at its default (0) both read as before the option existed; bad values
are refused in one line (CLI) or by an error naming it (library)."""

import json

import pytest
import torch

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.runner.jobs import Job, job_config
from routeformer.runner.spec import job_from_dict
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import ModelSpec, spec_dict
from tests.train.runs import SMALL_MQAR_RUN as RUN


def test_dropout_trains_is_recorded_and_is_off_by_default(tmp_path):
    plain, dropped, again = tmp_path / "plain", tmp_path / "dropout", tmp_path / "again"
    assert main([*RUN, "--out", str(plain)]) == 0
    assert "dropout" not in json.loads((plain / "config.json").read_text())["spec"]
    assert "dropout" not in json.loads((plain / "record.json").read_text())["model"]
    for run in (dropped, again):
        assert main([*RUN, "--model.dropout", "0.5", "--out", str(run)]) == 0
    assert json.loads((dropped / "config.json").read_text())["spec"]["dropout"] == 0.5
    assert json.loads((dropped / "record.json").read_text())["model"]["dropout"] == 0.5
    model = load_run_model(dropped).model
    assert {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)} == {0.5}
    weights = {name: load_run_model(run).model.state_dict() for name, run in
               (("plain", plain), ("dropout", dropped), ("again", again))}
    key = "lm_head.weight"
    assert not torch.equal(weights["plain"][key], weights["dropout"][key])  # the masks changed training
    assert all(torch.equal(weights["again"][k], v) for k, v in weights["dropout"].items())  # seeded


@pytest.mark.parametrize("value", ["1", "-0.1", "x"])
def test_a_bad_dropout_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, value):
    run = tmp_path / "run"
    assert main([*RUN, "--model.dropout", value, "--out", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("routeformer: error: argument --model.dropout: ")
    assert not run.exists()


@pytest.mark.parametrize("value", [1.0, -0.1, True, "0.1", None, float("nan")])
def test_the_library_refuses_a_bad_dropout_naming_it(value):
    with pytest.raises(ValueError, match=r"^dropout: a number in \[0, 1\); got "):
        ModelSpec(dropout=value)


def test_the_saved_forms_leave_the_default_out_and_round_trip():
    assert "dropout" not in spec_dict(ModelSpec()) and spec_dict(ModelSpec(dropout=0.2))["dropout"] == 0.2
    setup = QUICK.tasks["mqar"]
    job = Job("k", "mqar", setup.options, "full", {}, 0, setup, ModelSpec(dropout=0.2))
    assert job_from_dict(job_config(job)) == job
    assert "dropout" not in job_config(Job("k", "mqar", setup.options, "full", {}, 0, setup))["spec"]
