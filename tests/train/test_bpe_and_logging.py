"""From the command line: BPE training on a local file (train, eval, sample), TensorBoard logging,
and `train --help` listing every config key."""

import json

import pytest

from routeformer.cli import main
from routeformer.train.checkpoint import load_checkpoint
from tests.data.test_tokenizers import TEXT, train_bpe

TINY = ["--model.dim", "32", "--model.depth", "1", "--model.heads", "2", "--seq_len", "16",
        "--batch_size", "4", "--steps", "4", "--warmup_steps", "1", "--eval_every", "2",
        "--eval_tokens", "256", "--log_every", "1", "--checkpoint_every", "2", "--final_eval_tokens", "256"]


def test_bpe_training_on_a_local_file_runs_from_the_cli(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("ROUTEFORMER_CACHE_DIR", str(tmp_path / "cache"))
    reference = train_bpe(tmp_path / "tokenizer.json")
    (tmp_path / "corpus.txt").write_text(TEXT)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data.path", str(tmp_path / "corpus.txt"),
                 "--data.tokenizer", str(tmp_path), "--out_dir", str(run)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] == 4
    state = load_checkpoint(run)
    assert state["model_config"]["vocab_size"] == reference.get_vocab_size() + 1  # + _PAUSE_
    assert state["task"]["options"]["path"] == str(tmp_path / "corpus.txt")
    assert state["vocab"]["kind"] == "tokenizers"
    assert main(["eval", str(run), "--split", "test"]) == 0  # the task again: its text and tokeniser
    evaluated = json.loads(capsys.readouterr().out)
    assert {key: evaluated[key] for key in result["test"]} == result["test"]
    (tmp_path / "tokenizer.json").unlink()  # sample uses the tokeniser the checkpoint holds
    assert main(["sample", str(run), "--prompt", "The quick", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The quick")


def test_tensorboard_receives_what_metrics_jsonl_holds(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.logger", "tensorboard", "--out_dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = {event.step: event.value for event in events.Scalars("train/loss")}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in records if "loss" in r}, rel=1e-6)
    bits = {event.step: event.value for event in events.Scalars("val/bits_per_char")}
    assert bits == pytest.approx({r["step"]: r["val_bits_per_char"] for r in records
                                  if "val_bits_per_char" in r}, rel=1e-6)
    assert sorted(bits) == [2, 4]
    tested = {event.step: event.value for event in events.Scalars("test/bits_per_char")}
    assert tested == pytest.approx({4: records[-1]["test_bits_per_char"]}, rel=1e-6)  # the final line


def test_an_unknown_logger_is_refused_in_one_line(tmp_path, capsys):
    assert main(["train", "--train.logger", "wandb", "--out_dir", str(tmp_path)]) == 2
    assert "train.logger must be one of ('jsonl', 'tensorboard'); got 'wandb'" in capsys.readouterr().err


def test_train_help_lists_every_config_key_with_type_and_default(capsys):
    from routeformer.train.config import SECTIONS, section_types

    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for section in SECTIONS:
        for key in section_types(section):
            assert f"--{section}.{key} " in shown, key
    assert "--train.lr float (default 0.003)" in shown
    assert "--data.tokenizer str (default 'char')" in shown
    assert "--out_dir str (default 'runs/default')" in shown
