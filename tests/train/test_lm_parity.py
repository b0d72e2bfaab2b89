"""`routeformer train --config tiny.yaml` (`routeformer.train.train`: the config's task-lm job in its
run directory) and the same job trained as a sweep trains it (`runner.jobs.train_job`, no run
directory, no checkpoints) train the same weights (`runner.lm_config.lm_config_job`): every entry of
the two state dicts is equal, for the bundled config and for one that sets what else the
translation carries (meta-tokens, bf16, learned positions, one mechanism listed per layer, weight
decay, the cosine floor, clipping, betas, seed), and for a local text file (`data.path`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from routeformer.runner.jobs import train_job
from routeformer.runner.lm_config import lm_config_job
from routeformer.train import load_config, train

TINY = Path(__file__).resolve().parents[2] / "src" / "routeformer" / "configs" / "tiny.yaml"
CARRIED = ["--steps", "10", "--data.meta_density", "0.1", "--train.precision", "bf16",
           "--model.positions", "learned", "--model.max_seq_len", "32", "--model.attention", "[full, full]",
           "--train.weight_decay", "0.3", "--train.min_lr_ratio", "0.5", "--train.grad_clip", "0.5",
           "--train.beta1", "0.8", "--seed", "3"]


@pytest.mark.parametrize("overrides", [[], CARRIED, "local text"], ids=["tiny.yaml", "carried settings",
                                                                      "local text"])
def test_an_lm_run_config_and_its_task_job_train_equal_weights(tmp_path, overrides):
    if overrides == "local text":
        from tests.tasks.test_lm_text_sources import text_file

        overrides = ["--steps", "10", "--data.path", text_file(tmp_path / "notes.txt")]
    # a short final evaluation: it reads the trained weights, it does not change them
    config = load_config(str(TINY), ["--out_dir", str(tmp_path / "lm"), "--final_eval_tokens", "256",
                                     *overrides])
    job = lm_config_job(config, "tiny-parity")  # before train(): the loop rewrites config.model
    lm = train(config, quiet=True)
    kept = []
    record = train_job(job, log=lambda line: None, keep_model=kept.append)
    assert record["model"]["tie_embeddings"] is True
    assert record["train"]["betas"] == [config.train.beta1, config.train.beta2]
    assert record["train"]["weight_decay"] == config.train.weight_decay
    expected, got = lm.model.state_dict(), kept[0].state_dict()
    assert set(got) == set(expected)
    unequal = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not unequal, f"state-dict entries that differ: {unequal}"
