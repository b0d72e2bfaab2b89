"""`routeformer train --config tiny.yaml` (the LM loop) and the task path (`runner.jobs.train_job` on
task lm) train the same weights when the task job states the run's backbone, tied embeddings and
AdamW betas: every entry of the two state dicts is equal."""

from __future__ import annotations

from pathlib import Path

import torch

from routeformer.runner.jobs import Job, train_job
from routeformer.runner.setups import TaskSetup
from routeformer.train import load_config, train
from routeformer.train.on_task import ModelSpec
from routeformer.train.task_loop import TaskTrainConfig

TINY = Path(__file__).resolve().parents[2] / "src" / "routeformer" / "configs" / "tiny.yaml"


def task_job_for(config) -> Job:
    """The task-path job that trains what the LM run `config` trains (one stage on task lm)."""
    model, data, run = config.model, config.data, config.train
    assert isinstance(model.attention, str) and not data.path and data.tokenizer == "char"
    assert run.weight_decay == TaskTrainConfig().weight_decay  # the task path's (not an option)
    steps = run.schedule.steps
    assert steps % run.eval_every == 0  # the LM run's evaluation steps, as a count of evaluations
    evals = steps // run.eval_every  # train_job evaluates every steps // evals steps
    setup = TaskSetup({"corpus": data.corpus, "seq_len": data.seq_len}, run.schedule, evals=evals,
                      validation_sequences=max(1, run.eval_tokens // data.seq_len), test_sequences=8)
    spec = ModelSpec(dim=model.dim, depth=model.depth, heads=model.heads, mlp_ratio=model.mlp_ratio,
                     positions=model.positions, tie_embeddings=model.tie_embeddings)
    return Job("tiny-parity", "lm", dict(setup.options), model.attention,
               dict(model.attention_options.get(model.attention, {})), run.seed, setup, spec,
               betas=(run.beta1, run.beta2))


def test_tiny_yaml_and_its_task_job_train_equal_weights(tmp_path):
    # a short final evaluation: it reads the trained weights, it does not change them
    config = load_config(str(TINY), ["--out_dir", str(tmp_path / "lm"), "--final_eval_tokens", "256"])
    lm = train(config, quiet=True)
    job = task_job_for(config)
    assert job.spec.tie_embeddings and job.betas == (0.9, 0.99)  # the bridges this parity needs
    kept = []
    record = train_job(job, log=lambda line: None, keep_model=kept.append)
    assert record["model"]["tie_embeddings"] is True and record["train"]["betas"] == [0.9, 0.99]
    expected, got = lm.model.state_dict(), kept[0].state_dict()
    assert set(got) == set(expected)
    unequal = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not unequal, f"state-dict entries that differ: {unequal}"
