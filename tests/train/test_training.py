import json
import math

import pytest
import torch

from routeformer.train import load_config, train
from routeformer.train.checkpoint import load_checkpoint, load_trained_model
from routeformer.train.schedule import learning_rate

TINY = ["--model.dim", "32", "--model.depth", "2", "--model.heads", "2", "--seq_len", "32",
        "--batch_size", "8", "--steps", "12", "--warmup_steps", "3", "--eval_every", "6",
        "--eval_tokens", "1024", "--log_every", "2", "--checkpoint_every", "5",
        "--model.dropout", "0.1",
        "--final_eval_tokens", "4096"]  # not the whole 46k-character validation split: fast


def tiny_config(out_dir, *extra):
    return load_config(None, TINY + ["--out_dir", str(out_dir), *extra])


class Crash(Exception):
    pass


def stop_at(step_to_stop, error):
    def hook(step):
        if step == step_to_stop:
            raise error
    return hook


def assert_same_parameters(a, b):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_learning_rate_schedule():
    kwargs = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert learning_rate(0, **kwargs) == pytest.approx(0.1)
    assert learning_rate(9, **kwargs) == pytest.approx(1.0)
    assert learning_rate(60, **kwargs) == pytest.approx(0.55)
    assert learning_rate(110, **kwargs) == pytest.approx(0.1)


def test_training_lowers_the_loss_and_logs(tmp_path):
    result = train(tiny_config(tmp_path / "run", "--steps", "40", "--lr", "0.01"), quiet=True)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    assert records[-1]["final"] and records[-1]["val_bpc"] == pytest.approx(result.final_eval["bpc"])
    assert result.final_eval["bpc"] == pytest.approx(result.final_eval["loss"] / math.log(2))
    assert any("val_loss" in r for r in records[:-1])
    assert all(r["peak_mem_mib"] > 0 for r in records if "loss" in r)  # peak memory of the steps


@pytest.mark.parametrize("interruption", ["crash", "keyboard"])
def test_interrupted_run_resumes_bit_exactly(tmp_path, interruption):
    uninterrupted = train(tiny_config(tmp_path / "whole"), quiet=True)
    # A crash at step 7 loses steps 6-7 (last checkpoint: step 5) and replays them exactly;
    # Ctrl-C at step 7 saves a checkpoint at step 7 first.
    error = Crash() if interruption == "crash" else KeyboardInterrupt()
    with pytest.raises(type(error)):
        train(tiny_config(tmp_path / "split"), after_step=stop_at(7, error), quiet=True)
    saved_step = load_checkpoint(tmp_path / "split/checkpoint.pt")["step"]
    assert saved_step == (5 if interruption == "crash" else 7)
    resumed = train(tiny_config(tmp_path / "split"), quiet=True)
    assert_same_parameters(uninterrupted.model, resumed.model)
    assert resumed.final_eval == uninterrupted.final_eval
    whole_log = (tmp_path / "whole/metrics.jsonl").read_text().splitlines()
    split_log = (tmp_path / "split/metrics.jsonl").read_text().splitlines()
    def without_speed(lines):
        # Throughput and memory are measurements of the machine, not of the run.
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "peak_mem_mib")}
                for line in lines]

    assert without_speed(whole_log) == without_speed(split_log)


def test_checkpoint_reloads_the_trained_model(tmp_path):
    result = train(tiny_config(tmp_path / "run", "--model.attention", "local",
                               "--model.attention_options", "{local: {window: 8}}"), quiet=True)
    model, vocab, config = load_trained_model(tmp_path / "run")
    assert config.model.attention == "local" and vocab.tokens == result.vocab.tokens
    assert model.backbone.blocks[0].attention.window == 8
    tokens = vocab.encode("def f(x):")[None]
    torch.testing.assert_close(model(tokens).logits, result.model.eval()(tokens).logits)


def test_overrides_and_their_errors():
    config = load_config(None, ["--steps=7", "--model.attention", "[local, full]", "--model.depth", "2"])
    assert config.train.schedule.steps == 7 and config.model.attention == ["local", "full"]
    with pytest.raises(ValueError, match="unknown config key 'stpes'"):
        load_config(None, ["--stpes", "3"])
    with pytest.raises(ValueError, match="unknown train config key"):
        load_config(None, ["--train.bogus", "3"])
    with pytest.raises(ValueError, match="needs a value"):
        load_config(None, ["--steps"])


def test_meta_token_run_resumes_exactly_and_scores_real_characters_only(tmp_path):
    meta = ["--model.attention", "meta_tokens", "--data.meta_density", "0.2"]
    whole = train(tiny_config(tmp_path / "whole", *meta), quiet=True)
    assert whole.model.config.meta_token_id == whole.vocab.pause_id
    with pytest.raises(Crash):
        train(tiny_config(tmp_path / "split", *meta), after_step=stop_at(7, Crash()), quiet=True)
    resumed = train(tiny_config(tmp_path / "split", *meta), quiet=True)
    assert_same_parameters(whole.model, resumed.model)
    plain = train(tiny_config(tmp_path / "plain"), quiet=True)
    # Windows hold 26 real characters + 6 meta-tokens; the loss counts only real targets, so both
    # runs score (about) every character of the validation text once.
    assert whole.final_eval["tokens"] % 32 != 0
    assert 0.98 < whole.final_eval["tokens"] / plain.final_eval["tokens"] < 1.02
