"""One typed run spec: every job compare trains reads back from its own config.json form unchanged,
values are typed by their fields, overrides name the key they change, and a wrong key, type or path
is refused naming it."""

import json
from dataclasses import replace

import pytest

from routeformer.attention import list_attentions
from routeformer.compare.budgets import FULL, LONG, QUICK, lm_only, task_job
from routeformer.runner.jobs import job_config
from routeformer.runner.setups import Stage
from routeformer.runner.spec import job_from_dict, load_spec, with_overrides
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import json_form


def _budget_jobs():
    for budget in (QUICK, FULL, LONG):
        for task, setup in budget.tasks.items():
            for mechanism in sorted(list_attentions()):
                if lm_only(mechanism) and task not in ("lm", "code_lm"):
                    continue
                try:
                    key = f"{budget.name}-{task}-{mechanism}"
                    yield task_job(key, task, mechanism, 0, setup, budget.spec)
                except (ValueError, TypeError):  # a mechanism the budget cannot set up on this task
                    continue


def test_every_compare_job_reads_back_from_its_config_unchanged():
    jobs = list(_budget_jobs())
    assert len(jobs) > 30 and any(job.setup.staged for job in jobs)
    for job in jobs:
        data = json.loads(json.dumps(job_config(job)))
        back = job_from_dict(data)
        assert job_config(back) == data, job.key
        if json_form(job.setup.mechanism_options) == job.setup.mechanism_options:
            assert back == job, job.key  # else an option's tuple reads back as a list (JSON has no tuples)


def _quick_job():
    return task_job("mqar-topk", "mqar", "topk", 0, QUICK.tasks["mqar"], QUICK.spec)


def test_fields_left_out_at_their_default_and_set_ones_read_back():
    curriculum = (Stage({"seq_len": 16}, Schedule(5, 4, 1e-3, 1)),)
    job = replace(_quick_job(), precision="bf16", betas=(0.8, 0.95), weight_decay=0.0,
                  spec=replace(QUICK.spec, tie_embeddings=True),
                  setup=replace(QUICK.tasks["mqar"], curriculum=curriculum, eval_multiples=(2,)))
    assert job_from_dict(json.loads(json.dumps(job_config(job)))) == job


def test_values_are_typed_by_their_fields():
    data = job_config(_quick_job())
    data["setup"]["schedule"]["lr"] = "3e-4"
    data["setup"]["schedule"]["steps"] = "1_000"
    data["seed"] = 2.0
    job = job_from_dict(data)
    assert job.setup.schedule.lr == 3e-4 and job.setup.schedule.steps == 1000 and job.seed == 2


@pytest.mark.parametrize(("change", "message"), [
    (lambda data: data.pop("seed"), r"^seed: missing from the run spec"),
    (lambda data: data.update(colour="red"), r"^colour: not a key of the run spec"),
    (lambda data: data["spec"].update(width=3), r"^spec\.width: not a key of the run spec spec"),
    (lambda data: data["setup"]["schedule"].update(steps=2.5), r"^setup\.schedule\.steps must be an integer"),
    (lambda data: data["setup"].update(evals="many"), r"^setup\.evals must be an integer"),
    (lambda data: data["setup"].pop("schedule"), r"^setup\.schedule: missing"),
    (lambda data: data["setup"].update(curriculum=[{"options": {}}]), r"^setup\.curriculum\[0\] must be"),
    (lambda data: data.update(betas=[0.9]), r"betas: two numbers"),
    (lambda data: data.update(precision="fp8"), r"precision: one of"),
    (lambda data: data["spec"].update(tie_embeddings="yes"), r"^spec\.tie_embeddings must be true or false"),
])
def test_a_wrong_spec_is_refused_naming_the_key(change, message):
    data = job_config(_quick_job())
    change(data)
    with pytest.raises(ValueError, match=message):
        job_from_dict(data)


def test_overrides_set_dotted_keys_and_refuse_paths_that_lead_nowhere():
    data = job_config(_quick_job())
    changes = [("seed", "3"), ("spec.dim", "32"), ("setup.schedule.steps", "10"), ("options.topk", "4")]
    job = job_from_dict(with_overrides(data, changes))
    assert (job.seed, job.spec.dim, job.setup.schedule.steps, job.options["topk"]) == (3, 32, 10, 4)
    assert data["seed"] == 0  # the data given is not changed
    with pytest.raises(ValueError, match=r"^--spec\.width: no such key in the run spec; keys there"):
        with_overrides(data, [("spec.width", "3")])
    with pytest.raises(ValueError, match=r"^--seed\.x: 'seed' is no mapping"):
        with_overrides(data, [("seed.x", "3")])


def test_load_spec_reads_json_yaml_and_run_directories(tmp_path):
    job = _quick_job()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(job_config(job)))
    import yaml

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(job_config(job)))))
    assert load_spec(tmp_path / "run") == load_spec(tmp_path / "spec.yaml") == job
    with pytest.raises(ValueError, match=r"^argument --spec: cannot read"):
        load_spec(tmp_path / "missing.json")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match=r"holds no mapping"):
        load_spec(tmp_path / "list.yaml")


def _main(capsys, argv):
    from routeformer.cli import main

    status = main(argv)
    return status, capsys.readouterr()


def test_train_spec_retrains_a_run_from_its_config_and_takes_overrides(capsys, tmp_path):
    first, again, changed = tmp_path / "first", tmp_path / "again", tmp_path / "changed"
    base = ["train", "--task", "mqar", "--steps", "12", "--evals", "2", "--batch-size", "8"]
    assert _main(capsys, [*base, "--out", str(first)])[0] == 0
    status, captured = _main(capsys, ["train", "--spec", str(first), "--out", str(again)])
    assert status == 0, captured.err
    records = [json.loads((run / "record.json").read_text()) for run in (first, again)]
    for record in records:
        record.pop("train_seconds")
        for evaluation in record["validation"]:
            evaluation.pop("seconds", None)
    assert records[0] == records[1]  # the same job, the same weights and numbers
    assert (first / "config.json").read_text() == (again / "config.json").read_text()
    status, captured = _main(capsys, ["train", "--spec", str(first / "config.json"), "--seed", "1",
                                      "--spec.dim=32", "--out", str(changed)])
    assert status == 0, captured.err
    config = json.loads((changed / "config.json").read_text())
    assert config["seed"] == 1 and config["spec"]["dim"] == 32


@pytest.mark.parametrize(("arguments", "message"), [
    (["--task", "mqar"], r"argument --task: not with --spec"),
    (["--seed"], r"argument --seed: expected one argument"),
    (["--spec.width", "3"], r"--spec\.width: no such key"),
    (["stray"], r"argument 'stray': with --spec"),
    (["--seed", "x"], r"seed must be an integer"),
])
def test_train_spec_refuses_bad_lines_in_one_line_writing_nothing(capsys, tmp_path, arguments, message):
    import re

    (tmp_path / "spec.json").write_text(json.dumps(job_config(_quick_job())))
    out = tmp_path / "out"
    status, captured = _main(capsys, ["train", "--spec", str(tmp_path / "spec.json"), *arguments,
                                      "--out", str(out)])
    assert status == 2 and len(captured.err.strip().splitlines()) == 1, captured.err
    assert re.search(message, captured.err), captured.err
    assert not out.exists()
