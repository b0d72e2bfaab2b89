import json
import math

import pytest
import torch

from routeformer.train import load_config, train
from routeformer.train.checkpoint import load_checkpoint, load_run_model
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


def stopping_batches(call, error):
    """The LM task's `training_batch`, raising `error` while it draws its `call`-th training batch
    (the batch of step `call`)."""
    from routeformer.tasks.lm import CharLM

    calls, draw = [], CharLM.training_batch

    def counted(self, batch_size, generator):
        calls.append(batch_size)
        if len(calls) == call:
            raise error
        return draw(self, batch_size, generator)

    return counted


def stop_at_batch(monkeypatch, call, error):
    """Raise `error` while the LM task draws its `call`-th training batch, for this test."""
    from routeformer.tasks.lm import CharLM

    monkeypatch.setattr(CharLM, "training_batch", stopping_batches(call, error))


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
    losses = [r["loss"] for r in records if "loss" in r and "lr" in r]
    assert losses[-1] < losses[0] - 0.5
    final = result.final_eval
    assert records[-1]["final"] and records[-1]["test_bits_per_char"] == pytest.approx(final["bits_per_char"])
    assert final["bits_per_char"] == pytest.approx(final["loss"] / math.log(2))
    assert result.step == 40 and final == {key: value for key, value in result.record["test"].items()
                                           if not isinstance(value, dict)}
    assert any("val_loss" in r for r in records[:-1])
    assert all(r["peak_mem_mib"] > 0 for r in records if "lr" in r)  # peak memory of the steps


@pytest.mark.parametrize("interruption", ["crash", "keyboard"])
def test_interrupted_run_resumes_bit_exactly(tmp_path, monkeypatch, interruption):
    uninterrupted = train(tiny_config(tmp_path / "whole"), quiet=True)
    # Stopped inside step 8, either way: the run keeps its checkpoint after step 6 (its first
    # evaluation; checkpoint_every 5 saved step 5 before it) and replays steps 7-8 exactly.
    error = Crash() if interruption == "crash" else KeyboardInterrupt()
    stop_at_batch(monkeypatch, 8, error)
    with pytest.raises(type(error)):
        train(tiny_config(tmp_path / "split"), quiet=True)
    assert load_checkpoint(tmp_path / "split/record.train0.pt")["step"] == 6
    monkeypatch.undo()
    resumed = train(tiny_config(tmp_path / "split"), quiet=True)
    assert_same_parameters(uninterrupted.model, resumed.model)
    assert resumed.final_eval == uninterrupted.final_eval
    assert resumed.record["resumed"] == ["resumed from record.train0.pt after step 6"]
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
    run = load_run_model(tmp_path / "run")
    assert run.config["mechanism"] == "local" and run.tokenizer.tokens == result.vocab.tokens
    assert run.model.backbone.blocks[0].attention.window == 8
    tokens = run.tokenizer.encode("def f(x):")[None]
    torch.testing.assert_close(run.model(tokens).logits, result.model.eval()(tokens).logits)


def test_overrides_and_their_errors():
    config = load_config(None, ["--steps=7", "--model.attention", "[local, full]", "--model.depth", "2"])
    assert config.train.schedule.steps == 7 and config.model.attention == ["local", "full"]
    with pytest.raises(ValueError, match="unknown config key 'stpes'"):
        load_config(None, ["--stpes", "3"])
    with pytest.raises(ValueError, match="unknown train config key"):
        load_config(None, ["--train.bogus", "3"])
    with pytest.raises(ValueError, match="needs a value"):
        load_config(None, ["--steps"])


def test_meta_token_run_resumes_exactly(tmp_path, monkeypatch):
    meta = ["--model.attention", "meta_tokens", "--data.meta_density", "0.2"]
    whole = train(tiny_config(tmp_path / "whole", *meta), quiet=True)
    assert whole.model.config.meta_token_id == whole.vocab.pause_id
    stop_at_batch(monkeypatch, 8, Crash())
    with pytest.raises(Crash):
        train(tiny_config(tmp_path / "split", *meta), quiet=True)
    monkeypatch.undo()
    resumed = train(tiny_config(tmp_path / "split", *meta), quiet=True)
    assert_same_parameters(whole.model, resumed.model)
    assert resumed.final_eval == whole.final_eval
