import os
import subprocess
import sys
import time
import types

import pytest
import torch

from routeformer.data import CharVocab, corpora, load_corpus, random_batch, sequential_batches
from routeformer.data.corpora import data_dirs, load_data, load_path


def test_embedded_corpus_is_cpython_help_text_split_90_10():
    corpus = load_corpus("pydoc")
    total = len(corpus.train) + len(corpus.val)
    assert total > 400_000
    assert abs(len(corpus.train) / total - 0.9) < 1e-3
    assert "assert" in corpus.train


def test_text_corpus_and_errors(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 20)
    corpus = load_corpus(f"text:{path}")
    assert corpus.train + corpus.val == "abcdefghij" * 20
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(f"text:{tmp_path / 'missing.txt'}")
    with pytest.raises(ValueError, match="unknown corpus 'nope'.*pydoc"):
        load_corpus("nope")


def test_shared_tinyshakespeare_and_wikitext_load_when_present():
    if not any((d / "tinyshakespeare/input.txt").exists() for d in data_dirs()):
        pytest.skip("../shared/data is not beside the repository")
    assert "ROMEO" in load_corpus("tinyshakespeare").train
    wikitext = load_corpus("wikitext2")
    # Only the tokenised release is in ../shared/data: used, and named as such.
    assert wikitext.name == "wikitext2 tokenised release (trained on valid, evaluated on test)"
    assert " @-@ " in wikitext.train


def test_wikitext_hub_loader_is_used_without_a_local_copy(monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType("datasets")

    def load_dataset(name, config):
        calls.append((name, config))
        return {"train": {"text": [" = A = \n", "train text \n"] * 10},
                "validation": {"text": ["valid text \n"] * 20}}

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.chdir(tmp_path)  # no ./data or ../shared/data here
    monkeypatch.delenv("ROUTEFORMER_DATA_DIR", raising=False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(corpora, "hub_reachable", lambda: True)
    corpus = load_corpus("wikitext2")
    assert calls == [("wikitext", "wikitext-2-raw-v1")]  # the raw text, not the tokenised release
    assert corpus.train.startswith(" = A = \n") and "valid text" in corpus.val


def test_vocab_maps_unseen_characters_to_unknown_and_round_trips():
    vocab = CharVocab.from_text("hello world")
    ids = vocab.encode("hold€")
    assert ids[-1].item() == vocab.unknown_id == 0
    assert vocab.decode(vocab.encode("hello")) == "hello"
    again = CharVocab.from_dict(vocab.to_dict())
    assert again.tokens == vocab.tokens


def test_random_batch_labels_are_inputs_shifted():
    ids = torch.arange(100)
    inputs, labels = random_batch(ids, 4, 10, torch.Generator().manual_seed(0))
    assert torch.equal(labels, inputs + 1)
    with pytest.raises(ValueError, match="seq_len=200"):
        random_batch(ids, 4, 200, torch.Generator())


def test_sequential_batches_cover_the_text_once():
    ids = torch.arange(101)
    seen = torch.cat([inputs.flatten() for inputs, _ in sequential_batches(ids, 3, 10)])
    assert torch.equal(seen, torch.arange(100))


def test_a_local_file_or_folder_is_a_corpus(tmp_path):
    (tmp_path / "one.txt").write_text("a" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "two.md").write_text("b" * 60)
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 500)
    folder = load_path(tmp_path)
    assert folder.train + folder.val == "a" * 100 + "\n" + "b" * 60  # every text file, in path order
    assert "2 files" in folder.name
    assert load_data("pydoc", str(tmp_path / "one.txt")).train == "a" * 90  # data.path replaces corpus
    splits = tmp_path / "splits"
    splits.mkdir()
    (splits / "wiki.train.raw").write_text("train " * 30)
    (splits / "wiki.valid.raw").write_text("valid " * 30)
    corpus = load_path(splits)
    assert corpus.train == "train " * 30 and corpus.val == "valid " * 30
    with pytest.raises(ValueError, match="data.path .*missing.* is neither a file nor a folder"):
        load_path(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        load_path(tmp_path / "empty")


def test_a_local_raw_wikitext_copy_is_preferred(tmp_path, monkeypatch):
    for folder, word in (("wikitext-2-raw", "raw"), ("wikitext-2", "tokenised")):
        (tmp_path / folder).mkdir()
        for split in ("valid", "test"):
            (tmp_path / folder / f"{split}.txt").write_text(f"{word} {split} " * 20)
    monkeypatch.setenv("ROUTEFORMER_DATA_DIR", str(tmp_path))
    corpus = load_corpus("wikitext2")
    assert corpus.name == "wikitext2 (trained on valid, evaluated on test)"
    assert corpus.train.startswith("raw valid")


def test_without_network_wikitext_fails_in_one_line_within_seconds(tmp_path):
    """The real command, no local copy, the hub unreachable (an address that answers nothing): one
    line on stderr saying how to supply the data, in under 5 s of probing."""
    # Imports first: on a loaded machine they alone can take seconds; the wait is what is timed.
    script = ("import sys, time; import routeformer.train; from routeformer.data import corpora; "
              "from routeformer.cli import main; corpora.HUB_HOST = '192.0.2.1'; "
              "began = time.perf_counter(); "
              "status = main(['train', '--data.corpus', 'wikitext2', "
              f"'--out_dir', {str(tmp_path / 'run')!r}]); "
              "print(round(time.perf_counter() - began, 2)); sys.exit(status)")
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    environment["ROUTEFORMER_DATA_DIR"] = str(tmp_path)
    finished = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment,
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and "--data.path" in lines[0], finished.stderr
    assert float(finished.stdout.strip()) < 5


def test_offline_mode_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ROUTEFORMER_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    began = time.perf_counter()
    with pytest.raises(ValueError, match="offline mode is set; download wikitext-2-raw-v1"):
        load_corpus("wikitext2")
    assert time.perf_counter() - began < 1
