"""`routeformer train --task lm --config FILE`: the LM run config FILE, with the line's overrides,
trained as a task run (`runner.lm_config.lm_config_job` -> the run directory of runner/run_dir.py)
gives the weights `routeformer train --config FILE` gives (also for a local text file, `data.path`,
and a BPE `data.tokenizer`, whose task runs eval and sample read); every setting the task path
cannot honour is refused naming its config key, in one line on the command line and before anything
is written.
A job's AdamW `weight_decay` reaches the optimizer and is saved only where it is not the default."""

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from routeformer.cli import main
from routeformer.compare.budgets import QUICK
from routeformer.runner.jobs import TASK_WEIGHT_DECAY, Job, job_config, staged_record
from routeformer.runner.lm_config import lm_config_job
from routeformer.runner.run_dir import run_in_directory
from routeformer.tasks import build_task
from routeformer.tasks.meta_tokens import real_tokens_per_window
from routeformer.train import driver, load_config
from routeformer.train.checkpoint import load_run_model
from routeformer.train.on_task import ModelSpec, build_task_model, spec_dict
from routeformer.train.schedule import Schedule
from routeformer.train.task_loop import TRAIN_FIELD_DEFAULTS, TaskTrainConfig, without_defaults
from tests.train.runs import hide_tensorboard

TINY = str(Path(__file__).resolve().parents[2] / "src" / "routeformer" / "configs" / "tiny.yaml")
# the overrides apply on both paths: a narrower, shorter run, with a short final evaluation
OVERRIDES = ["--model.dim", "16", "--steps", "10", "--final_eval_tokens", "256"]
HYBRID_OPTIONS = "{local: {window: 8}, topk: {topk: 4}}"  # topk's are not a layer's: left out of the job


def test_the_task_run_of_a_config_trains_the_lm_runs_weights(tmp_path, capsys):
    lm, task = tmp_path / "lm", tmp_path / "task"
    assert main(["train", "--config", TINY, "--out_dir", str(lm), *OVERRIDES]) == 0
    assert main(["train", "--task", "lm", "--config", TINY, *OVERRIDES, "--out", str(task)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out_dir"] == str(task) and summary["steps"] == 10
    config = json.loads((task / "config.json").read_text())
    assert config["task"] == "lm" and config["task_options"] == {"corpus": "pydoc", "seq_len": 32}
    assert config["spec"]["dim"] == 16 and config["spec"]["tie_embeddings"] is True
    assert config["betas"] == [0.9, 0.99] and "weight_decay" not in config  # tiny.yaml's 0.1
    assert config["setup"]["evals"] == 1 and config["setup"]["test_sequences"] == 8
    expected, got = load_run_model(lm).model.state_dict(), load_run_model(task).model.state_dict()
    assert set(got) == set(expected)
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    # the same command again reads the finished run back
    assert main(["train", "--task", "lm", "--config", TINY, *OVERRIDES, "--out", str(task)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["resumed"] == []


@pytest.mark.parametrize(("extra", "option"), [
    (["--data.pack_documents", "true"], {"pack_documents": True}),
    (["--data.meta_density", "0.1"], {"meta_density": 0.1}),
    (["--model.dropout", "0.2"], {}),
    (["--model.positions", "learned", "--model.max_seq_len", "64"], {}),
    (["--model.attention", "[local, full]", "--model.attention_options", HYBRID_OPTIONS], {}),
    (["--data.meta_density", "0.1", "--model.meta_token_id", "3", "--model.zero_meta_positions_train", "true",
      "--model.zero_meta_positions_eval", "true", "--model.positions", "learned"], {"meta_density": 0.1}),
], ids=["packed documents", "meta-tokens", "dropout", "a longer learned position table",
        "a mechanism per layer", "no positions at meta-tokens"])
def test_packing_meta_tokens_dropout_and_positions_train_the_lm_runs_weights(tmp_path, capsys, extra, option):
    lm, task = tmp_path / "lm", tmp_path / "task"
    assert main(["train", "--config", TINY, "--out_dir", str(lm), *OVERRIDES, *extra]) == 0
    assert main(["train", "--task", "lm", "--config", TINY, *OVERRIDES, *extra, "--out", str(task)]) == 0
    config = json.loads((task / "config.json").read_text())
    assert config["task_options"] == {"corpus": "pydoc", "seq_len": 32, **option}
    expected, got = load_run_model(lm).model.state_dict(), load_run_model(task).model.state_dict()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    plain = tmp_path / "plain"  # the option changed the weights: the test above could fail
    assert main(["train", "--task", "lm", "--config", TINY, *OVERRIDES, "--out", str(plain)]) == 0
    assert not torch.equal(load_run_model(plain).model.state_dict()["lm_head.weight"], got["lm_head.weight"])


def test_an_eval_every_that_does_not_divide_the_steps_evaluates_at_the_lm_runs_steps(tmp_path, capsys):
    lm, task = tmp_path / "lm", tmp_path / "task"
    every = [*OVERRIDES, "--train.eval_every", "4"]  # 10 steps: evaluations after 4 and 8, then the end
    assert main(["train", "--config", TINY, "--out_dir", str(lm), *every]) == 0
    assert main(["train", "--task", "lm", "--config", TINY, *every, "--out", str(task)]) == 0
    capsys.readouterr()
    assert json.loads((task / "config.json").read_text())["setup"]["eval_every"] == 4
    record = json.loads((task / "record.json").read_text())
    assert [entry["step"] for entry in record["validation"]] == [4, 8, 10]
    lm_steps = [json.loads(line)["step"] for line in (lm / "metrics.jsonl").read_text().splitlines()
                if "val_bits_per_char" in json.loads(line)]
    assert lm_steps == [4, 8, 10]
    expected, got = load_run_model(lm).model.state_dict(), load_run_model(task).model.state_dict()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    limited = lm_config_job(load_config(TINY, ["--train.max_nonfinite_steps", "3"]), "k")
    assert limited.max_nonfinite_steps == 3 and job_config(limited)["max_nonfinite_steps"] == 3
    assert "max_nonfinite_steps" not in job_config(lm_config_job(load_config(TINY), "k"))
    dividing = lm_config_job(load_config(TINY, [*OVERRIDES, "--train.eval_every", "5"]), "k")
    assert "eval_every" not in dividing.setup.as_dict() and dividing.setup.evals == 2  # as before


def _text_source(tmp_path, source):
    """(overrides, task options): the LM run's overrides for `source` ("file": a local text file;
    else that file with a BPE tokenizer trained offline) and the task options they translate to."""
    from tests.tasks.test_lm_text_sources import text_file

    path = text_file(tmp_path / "notes.txt")
    if source == "file":
        return ["--data.path", path], {"path": path}
    pytest.importorskip("tokenizers")
    from tests.data.test_tokenizers import train_bpe

    (tmp_path / "bpe").mkdir()
    train_bpe(tmp_path / "bpe" / "tokenizer.json")
    spec = str(tmp_path / "bpe")
    return ["--data.path", path, "--data.tokenizer", spec], {"path": path, "tokenizer": spec}


@pytest.mark.parametrize("source", ["file", "file and bpe tokenizer"])
def test_a_local_text_and_a_bpe_tokenizer_train_the_lm_runs_weights(tmp_path, capsys, monkeypatch, source):
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(tmp_path / "cache"))
    text, options = _text_source(tmp_path, source)
    lm, task = tmp_path / "lm", tmp_path / "task"
    assert main(["train", "--config", TINY, "--out_dir", str(lm), *OVERRIDES, *text]) == 0
    assert main(["train", "--task", "lm", "--config", TINY, *OVERRIDES, *text, "--out", str(task)]) == 0
    capsys.readouterr()
    config = json.loads((task / "config.json").read_text())
    assert config["task_options"] == {"corpus": "pydoc", "seq_len": 32, **options}
    expected, task_run = load_run_model(lm).model.state_dict(), load_run_model(task)
    got = task_run.model.state_dict()
    assert set(got) == set(expected)
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    lm_tokenizer = load_run_model(lm, build_task=False).tokenizer
    assert task_run.tokenizer.to_dict() == task_run.task.vocab.to_dict() == lm_tokenizer.to_dict()
    # eval and sample read the task run directory
    record = json.loads((task / "record.json").read_text())
    assert main(["eval", str(task)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["bits_per_char"] == record["validation"][-1]["bits_per_char"]
    assert main(["sample", str(task), "--prompt", "the quick", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the quick")


def test_log_stats_become_each_evaluations_training_step_statistics(tmp_path, capsys):
    lm, task = tmp_path / "lm", tmp_path / "task"
    stats = [*OVERRIDES, "--train.log_stats", "[flops]"]  # every layer's executed attention FLOPs
    assert main(["train", "--config", TINY, "--out_dir", str(lm), *stats]) == 0
    assert main(["train", "--task", "lm", "--config", TINY, *stats, "--out", str(task)]) == 0
    capsys.readouterr()
    assert json.loads((task / "config.json").read_text())["log_stats"] == ["flops"]
    record = json.loads((task / "record.json").read_text())
    assert record["validation"] and all(entry["attn_flops"] > 0 for entry in record["validation"])
    lines = [json.loads(line) for line in (task / "metrics.jsonl").read_text().splitlines()]
    assert [line["attn_flops"] for line in lines if "train_loss" in line] == [
        entry["attn_flops"] for entry in record["validation"]]
    expected, got = load_run_model(lm).model.state_dict(), load_run_model(task).model.state_dict()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    assert "log_stats" not in job_config(lm_config_job(load_config(TINY), "k"))  # the default: none
    for bad in ("flops", [3], [""]):
        with pytest.raises(ValueError, match=r"^log_stats: a list of layer statistic names"):
            TaskTrainConfig(log_stats=bad)


def test_the_configs_logger_is_the_run_directorys(tmp_path, capsys, monkeypatch):
    hide_tensorboard(monkeypatch)  # so the logger's own refusal shows it reached the run directory
    argv = ["train", "--task", "lm", "--config", TINY, "--train.logger", "tensorboard",
            "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    assert "logger 'tensorboard' needs the tensorboard package" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_what_the_task_path_honours_or_does_not_apply_is_accepted():
    config = load_config(TINY, ["--model.attention", "[local, local]", "--model.attention_options",
                                "{local: {window: 8}, topk: {topk: 4}}", "--checkpoint_every", "3",
                                "--keep_checkpoints", "1", "--log_every", "1", "--model.num_classes", "5",
                                "--model.positions", "learned", "--model.max_seq_len", "16",
                                "--data.meta_density", "0.2", "--train.precision", "bf16"])
    job = lm_config_job(config, "k")
    assert (job.mechanism, job.options, job.precision) == ("local", {"window": 8}, "bf16")
    assert (job.checkpoint_every, job.keep_checkpoints, job.log_every) == (3, 1, 1)
    hybrid = lm_config_job(load_config(TINY, ["--model.attention", "[local, full]",
                                              "--model.attention_options", HYBRID_OPTIONS]), "k")
    assert (hybrid.mechanism, hybrid.options) == (["local", "full"], {"local": {"window": 8}})
    assert job.task_options == {"corpus": "pydoc", "seq_len": 32, "meta_density": 0.2}
    real = real_tokens_per_window(32, 0.2)  # the real tokens of a window: eval_tokens are read in them
    assert real < 32 and job.setup.validation_sequences == 2048 // real
    everything = lm_config_job(load_config(TINY), "k").setup.test_sequences  # the whole test split
    assert everything == (len(build_task("lm", corpus="pydoc", seq_len=32).ids("test")) - 1) // 32
    with pytest.raises(TypeError, match="config: a routeformer.train.config.RunConfig"):
        lm_config_job(config.to_dict(), "k")


CLI_REFUSED = [
    (["--task", "code_lm"], "argument --task: with --config the task is lm"),
    (["--task", "mqar"], "argument --task: with --config the task is lm"),
    (["--task", "lm", "--mechanism", "local"], "argument --mechanism: not with --config"),
    (["--task", "lm", "--option", "corpus=pydoc"], "argument --option: not with --config"),
    (["--task", "lm", "--evals", "2"], "argument --evals: not with --config"),
    (["--task", "lm", "--betas", "0.9", "0.95"], "use --train.beta1 and --train.beta2"),
    (["--task", "lm", "--budget=long"], "argument --budget: not with --config"),
    (["--task", "lm", "--keep-checkpoints", "3"], "use --train.keep_checkpoints"),
    (["--task", "lm", "--out_dir", "x"], "argument --out_dir: not with --config"),
    (["--task", "lm", "--nokey", "3"], "unknown config key 'nokey'"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_REFUSED, ids=[" ".join(a) for a, _ in CLI_REFUSED])
def test_the_command_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    run = tmp_path / "run"
    assert main(["train", "--config", TINY, *argv, "--out", str(run)]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert error.startswith("routeformer: error: ") and "\n" not in error, error
    assert message in error and captured.out == ""
    assert not run.exists()


def _small_job(**changes) -> Job:
    setup = replace(QUICK.tasks["mqar"], schedule=Schedule(steps=2, batch_size=8, lr=1e-3, warmup_steps=1),
                    evals=1, validation_sequences=8, test_sequences=8)
    return replace(Job("wd", "mqar", dict(setup.options), "full", {}, 0, setup,
                       ModelSpec(dim=16, depth=1, heads=2, positions="rotary")), **changes)


def test_a_jobs_weight_decay_reaches_adamw_and_is_saved(tmp_path, monkeypatch):
    seen, build = [], driver.build_optimizer

    def recorded(model, **settings):
        seen.append(settings["weight_decay"])
        return build(model, **settings)

    monkeypatch.setattr(driver, "build_optimizer", recorded)
    run = tmp_path / "run"
    record = run_in_directory(run, _small_job(weight_decay=0.25), log=lambda line: None)
    assert seen == [0.25] and record["train"]["weight_decay"] == 0.25
    assert json.loads((run / "config.json").read_text())["weight_decay"] == 0.25
    with pytest.raises(ValueError, match=r"a finished run \(weight_decay 0.25 -> 0.1\): it trains on only"):
        run_in_directory(run, _small_job(), log=lambda line: None)


def test_the_default_weight_decay_leaves_saved_forms_as_they_were():
    job = _small_job()
    assert TASK_WEIGHT_DECAY == TaskTrainConfig().weight_decay == 0.1 and job.weight_decay == 0.1
    before = {**asdict(job), "setup": job.setup.as_dict(), "spec": spec_dict(job.spec)}
    del before["weight_decay"]  # the job as config.json held it before the field existed
    assert json.dumps(job_config(job)) == json.dumps(without_defaults(before, TRAIN_FIELD_DEFAULTS))
    assert job_config(_small_job(weight_decay=0.0))["weight_decay"] == 0.0
    staged = replace(job.setup, eval_multiples=(2,))
    task = build_task("mqar", **job.task_options)
    model = build_task_model(task, "full", {}, job.spec)
    assert "weight_decay" not in staged_record(replace(job, setup=staged), task, model, [], 0.0)
    decayed = replace(job, setup=staged, weight_decay=0.5)
    assert staged_record(decayed, task, model, [], 0.0)["weight_decay"] == 0.5


@pytest.mark.parametrize("decay", [-0.1, float("nan"), float("inf"), "0.1", True, None])
def test_a_bad_weight_decay_is_refused_naming_it(decay):
    with pytest.raises(ValueError, match="weight_decay: a finite number >= 0"):
        _small_job(weight_decay=decay)


def test_a_specs_longer_position_table_is_built_saved_only_where_set_and_checked():
    task = build_task("mqar", **QUICK.tasks["mqar"].options)
    spec = ModelSpec(dim=16, depth=1, heads=2, positions="learned", max_seq_len=task.seq_len + 8)
    model = build_task_model(task, "full", {}, spec)
    assert model.config.max_seq_len == task.seq_len + 8
    shorter = build_task_model(task, "full", {}, replace(spec, max_seq_len=4))  # at least the task's
    assert shorter.config.max_seq_len == task.seq_len
    assert "max_seq_len" not in spec_dict(replace(spec, max_seq_len=0))
    assert spec_dict(spec)["max_seq_len"] == task.seq_len + 8
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"^max_seq_len: an integer >= 0 \(0: the task"):
            replace(spec, max_seq_len=bad)
